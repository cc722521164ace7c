// The parts of the `neuron` device that PyTorch only lets C++ provide (torch 2.13): the
// PrivateUse1 hooks (pinned host memory, storage resize, generators) and a stateful device
// guard. Built once per torch version by torch_bridge/_native.py and loaded with ctypes; every
// entry point Python calls is `extern "C"` below. Nothing here calls Python except the storage
// allocator callbacks (resize), which Python registers; the guard's methods never do, so they
// are safe inside autograd's worker threads and while an exception unwinds.

#include <ATen/EmptyTensor.h>
#include <c10/core/InferenceMode.h>
#include <ATen/TensorOperators.h>
#include <ATen/autocast_mode.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/ops/add_compositeexplicitautogradnonfunctional_dispatch.h>
#include <ATen/ops/add_ops.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/div_compositeexplicitautogradnonfunctional_dispatch.h>
#include <ATen/ops/div_ops.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/mul_compositeexplicitautogradnonfunctional_dispatch.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/native_batch_norm.h>
#include <ATen/ops/pad.h>
#include <ATen/ops/sub_compositeexplicitautogradnonfunctional_dispatch.h>
#include <ATen/ops/sub_ops.h>
#include <ATen/ops/rsub.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <pthread.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <unordered_map>
#include <unordered_set>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace trnsim_neuron {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

// ---- devices -----------------------------------------------------------------------------------
// How many logical NeuronCores the configured chip has. Python sets it before first use (the
// autograd engine sizes its per-device queues from it at the first backward).
std::atomic<int> g_device_count{1};
thread_local c10::DeviceIndex t_device = 0;  // the calling thread's current device, as CUDA keeps it

void check_index(c10::DeviceIndex index) {
  int count = g_device_count.load();
  TORCH_CHECK(index >= 0 && index < count, "neuron:", static_cast<int>(index), " does not exist: the device has ",
              count, " logical NeuronCores (neuron:0..neuron:", count - 1, ")");
}

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNeuron; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (d.index() >= 0 && d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kNeuron, t_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kNeuron, "expected a neuron device, got ", d);
    if (d.index() < 0) return;
    check_index(d.index());
    t_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) t_device = d.index();
  }
  // Streams and events run in simulated time (torch.neuron.Stream/Event, in Python); to PyTorch
  // every neuron stream is the default one, already complete.
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(g_device_count.load());
  }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

// ---- pinned host memory ------------------------------------------------------------------------
// Page-locked host memory the device's DMA engines read directly. Here it is ordinary host
// memory whose address ranges are remembered, so `is_pinned()` and the copies that check it
// (non_blocking transfers) behave as they do on a CUDA machine.
std::mutex g_pinned_mutex;
std::map<uintptr_t, size_t> g_pinned;  // base address -> bytes
std::atomic<int64_t> g_pinned_bytes{0};
std::atomic<int64_t> g_pinned_allocs{0};

void pinned_free(void* p) {
  if (p == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    auto it = g_pinned.find(reinterpret_cast<uintptr_t>(p));
    if (it != g_pinned.end()) {
      g_pinned_bytes -= static_cast<int64_t>(it->second);
      g_pinned.erase(it);
    }
  }
  c10::free_cpu(p);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    if (p != nullptr) {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned[reinterpret_cast<uintptr_t>(p)] = n;
      g_pinned_bytes += static_cast<int64_t>(n);
      g_pinned_allocs += 1;
    }
    return {p, p, &pinned_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator g_pinned_allocator;

bool is_pinned(const void* data) {
  auto a = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  auto it = g_pinned.upper_bound(a);
  if (it == g_pinned.begin()) return false;
  --it;
  return a >= it->first && a < it->first + it->second;
}

// ---- host memory behind device tensors -------------------------------------------------------
// Device memory is host memory here, and glibc hands big freed blocks back to the kernel (it
// trims the top of a heap, and autograd's device thread has its own arena, which trims eagerly),
// so a training loop's fresh results fault their pages in again every step: ~20k page faults per
// step of the small GPT-2 on that thread alone, where the CPU run reuses its memory. The CPU
// kernels that compute neuron results allocate through this cache instead, which keeps freed
// blocks of each size for reuse, as a device runtime's caching allocator does. It is host-side
// only: the virtual HBM's ledger still counts every allocation and free as before.
//
// It serves an allocation only inside a `HostScope` (the fast path's CPU kernels, the Python
// path's redispatch, torch_bridge.memory.allocate) and only blocks of at least kCacheMin bytes;
// every other CPU allocation goes to the CPU allocator that
// was installed before, unchanged. It becomes the CPU allocator only when the first neuron result
// is computed, so a process that never computes on neuron (`import torch` alone) is untouched.
// TRNSIM_HOST_CACHE_MB bounds the bytes it keeps free (default 2048; 0 turns it off).
// kCacheMin: glibc keeps blocks under 128 KiB mapped, so they fault nothing in, but from ~1 KiB
// (past its per-thread cache) each costs a bin search in malloc and a consolidation in free, which
// an RNN's thousands of [batch, 4 x hidden] results per step pay: serving blocks from 4 KiB here
// cut the zoo LSTM's neuron step by ~7% against 64 KiB (from 1 KiB: no more).
constexpr size_t kCacheMin = 4 * 1024;
thread_local int t_host_scope = 0;

void host_free(void* p);

struct HostCache final : c10::Allocator {
  c10::Allocator* base = nullptr;  // the CPU allocator before this one
  std::mutex mutex;
  std::unordered_map<size_t, std::vector<void*>> free_blocks;  // bytes -> blocks kept for reuse
  std::unordered_map<void*, size_t> owned;  // every block this cache allocated and has not released
  int64_t limit = 0;       // bytes it may keep free
  int64_t kept = 0;        // bytes kept free now
  int64_t reused = 0;      // allocations served from kept blocks
  int64_t fresh = 0;       // allocations that took new memory

  c10::DataPtr allocate(size_t n) override {
    if (t_host_scope == 0 || n < kCacheMin || c10::memoryProfilingEnabled()) return base->allocate(n);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto it = free_blocks.find(n);
      if (it != free_blocks.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        kept -= static_cast<int64_t>(n);
        reused += 1;
      }
    }
    if (p == nullptr) {
      p = c10::alloc_cpu(n);  // (throws the CPU allocator's own out-of-memory error)
      std::lock_guard<std::mutex> lock(mutex);
      owned[p] = n;
      fresh += 1;
    }
    return {p, p, &host_free, c10::Device(c10::DeviceType::CPU)};
  }
  // also frees what `base` allocated (raw_allocate hands out either)
  c10::DeleterFnPtr raw_deleter() const override { return &host_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  // frees every kept block; returns the bytes released
  int64_t release() {
    std::vector<void*> out;
    int64_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (auto& kv : free_blocks) {
        for (void* p : kv.second) {
          owned.erase(p);
          out.push_back(p);
          bytes += static_cast<int64_t>(kv.first);
        }
      }
      free_blocks.clear();
      kept = 0;
    }
    for (void* p : out) c10::free_cpu(p);
    return bytes;
  }
};
HostCache& g_host = *new HostCache();  // never destroyed: tensors may outlive static destructors
std::once_flag g_host_once;
std::atomic<bool> g_host_on{false};

void host_free(void* p) {
  if (p == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_host.mutex);
    auto it = g_host.owned.find(p);
    if (it != g_host.owned.end()) {
      auto n = static_cast<int64_t>(it->second);
      if (g_host.kept + n <= g_host.limit) {
        g_host.free_blocks[it->second].push_back(p);
        g_host.kept += n;
        return;
      }
      g_host.owned.erase(it);  // over the limit: back to the system
    } else if (g_host.base != nullptr && g_host.base->raw_deleter() != nullptr) {
      g_host.base->raw_deleter()(p);  // the base allocator's block (raw_deallocate hands either back)
      return;
    }
  }
  c10::free_cpu(p);
}

void host_install() {
  std::call_once(g_host_once, [] {
    const char* env = std::getenv("TRNSIM_HOST_CACHE_MB");
    int64_t mb = 2048;
    if (env != nullptr && *env != '\0') {
      char* end = nullptr;
      long long v = std::strtoll(env, &end, 10);
      if (end != nullptr && *end == '\0' && v >= 0) mb = v;
    }
    if (mb == 0) return;
    g_host.limit = mb << 20;
    // a fork (DataLoader workers) must not copy the lock held by another thread: the child frees
    // its copies of cached tensors through host_free
    pthread_atfork([] { g_host.mutex.lock(); }, [] { g_host.mutex.unlock(); }, [] { g_host.mutex.unlock(); });
    g_host.base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&g_host, 0);
    g_host_on.store(c10::GetCPUAllocator() == &g_host);  // (an allocator of higher priority stays)
  });
}

// enter (+1) or leave (-1) a stretch of this thread's CPU allocations that back neuron tensors
void host_scope(int delta) {
  if (delta > 0 && !g_host_on.load(std::memory_order_relaxed)) host_install();
  t_host_scope += delta;
}

// give every kept block back to the system (torch.neuron.empty_cache); returns the bytes released
int64_t host_release_all() { return g_host_on.load() ? g_host.release() : 0; }

// CPU allocations on this thread that back neuron tensors, while it lives
struct HostScope {
  HostScope() { host_scope(1); }
  ~HostScope() { host_scope(-1); }
  HostScope(const HostScope&) = delete;
  HostScope& operator=(const HostScope&) = delete;
};

// ---- generators --------------------------------------------------------------------------------
// A device generator's state has CUDA's shape: a 64-bit seed and a 64-bit offset into the
// counter-based (Philox-style) stream, 16 bytes (DTensor's RNG tracker reads that layout). Each
// random op reads (seed, offset) and advances the offset by what it drew (in Python).
constexpr uint64_t kDefaultSeed = 67280421310721ULL;  // CUDA's default_rng_seed_val

struct NeuronGenerator final : c10::GeneratorImpl {
  NeuronGenerator(c10::DeviceIndex index, uint64_t seed)
      : c10::GeneratorImpl(c10::Device(kNeuron, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        seed_(seed) {}
  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
  }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    uint64_t s = c10::detail::getNonDeterministicRandom(true);
    set_current_seed(s);
    return s;
  }
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.dtype() == caffe2::TypeMeta::Make<uint8_t>() && state.numel() == 16,
                "neuron generator state must be a torch.ByteTensor of 16 bytes (seed, offset), got ",
                state.numel(), " elements of ", state.dtype().name());
    const auto* bytes = static_cast<const uint8_t*>(state.data());
    std::memcpy(&seed_, bytes, 8);
    std::memcpy(&offset_, bytes + 8, 8);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto t = at::detail::empty_cpu({16}, c10::ScalarType::Byte);
    auto* bytes = static_cast<uint8_t*>(t.mutable_data_ptr());
    std::memcpy(bytes, &seed_, 8);
    std::memcpy(bytes + 8, &offset_, 8);
    return t.getIntrusivePtr();
  }
  static c10::DeviceType device_type() { return kNeuron; }

 private:
  NeuronGenerator* clone_impl() const override {
    auto* g = new NeuronGenerator(device().index(), seed_);
    g->offset_ = offset_;
    return g;
  }
  uint64_t seed_;
  uint64_t offset_ = 0;
};

std::mutex g_gen_mutex;
std::vector<std::unique_ptr<at::Generator>> g_default_generators;

const at::Generator& default_generator(c10::DeviceIndex index) {
  if (index < 0) index = t_device;
  check_index(index);
  std::lock_guard<std::mutex> lock(g_gen_mutex);
  if (g_default_generators.size() <= static_cast<size_t>(index)) g_default_generators.resize(index + 1);
  auto& slot = g_default_generators[index];
  if (!slot) slot = std::make_unique<at::Generator>(at::make_generator<NeuronGenerator>(index, kDefaultSeed));
  return *slot;
}

// ---- storage resize through Python's allocator -------------------------------------------------
// Device memory is allocated and counted by Python (torch_bridge.memory); a resize asks it for a
// block through `g_alloc` (returns a token that keeps the block alive, 0 with a message on
// failure) and hands the token back through `g_release` when the storage lets go of it.
using AllocFn = int64_t (*)(int device, int64_t nbytes, void** ptr, char* error, int error_len);
using ReleaseFn = void (*)(int64_t token);
AllocFn g_alloc = nullptr;
ReleaseFn g_release = nullptr;

void release_block(void* ctx) {
  if (ctx != nullptr && g_release != nullptr) g_release(reinterpret_cast<int64_t>(ctx));
}

void resize_storage(const c10::Storage& storage, size_t newsize) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  size_t old = impl->nbytes();
  if (newsize == old) return;
  c10::DeviceIndex index = impl->device().index();
  if (index < 0) index = 0;
  TORCH_CHECK(g_alloc != nullptr, "neuron: storage resize needs the device's allocator (torch_bridge not registered)");
  void* ptr = nullptr;
  int64_t token = 0;
  if (newsize > 0) {
    char error[512] = {0};
    token = g_alloc(index, static_cast<int64_t>(newsize), &ptr, error, sizeof(error) - 1);
    TORCH_CHECK_WITH(OutOfMemoryError, token != 0, error);
    size_t keep = std::min(old, newsize);
    if (keep > 0 && impl->data() != nullptr) std::memcpy(ptr, impl->data(), keep);
  }
  c10::DataPtr data(ptr, reinterpret_cast<void*>(token), &release_block, c10::Device(kNeuron, index));
  impl->set_data_ptr_noswap(std::move(data));
  impl->set_nbytes(newsize);
}


// ---- device memory: the ledger ---------------------------------------------------------------
// Every device allocation's bytes are counted here, by Python's allocations (torch_bridge.memory
// calls these functions) and by the fast path's alike, under one lock: a MemoryStats is a row of
// int64 counters that Python reads in place. Layout (kStatLen): [bytes, count][all, large_pool,
// small_pool][current, peak, allocated, freed], then ooms and capacity.
constexpr int kStatLen = 26, kOoms = 24, kCapacity = 25;
constexpr int64_t kSmallBlock = 1 << 20;  // CUDA's small pool: requests up to 1 MiB
// Never destroyed: a block can be freed while the process exits, after static destructors ran.
std::mutex& g_mem_mutex = *new std::mutex();
std::vector<int64_t*>& g_pool = *new std::vector<int64_t*>();  // the eager device's MemoryStats rows, per core

void stat_add(int64_t* s, int64_t n) {
  s[0] += n;
  s[2] += n;
  if (s[0] > s[1]) s[1] = s[0];
}

void stat_sub(int64_t* s, int64_t n, bool undo) {
  s[0] -= n;
  s[3] += n;
  if (undo) {  // an allocation that never happened: not a free
    s[3] -= n;
    s[2] -= n;
  }
}

void mem_add_locked(int64_t* st, int64_t nbytes) {
  int pool = nbytes <= kSmallBlock ? 2 : 1;
  stat_add(st, nbytes);
  stat_add(st + pool * 4, nbytes);
  stat_add(st + 12, 1);
  stat_add(st + 12 + pool * 4, 1);
}

void mem_sub_locked(int64_t* st, int64_t nbytes, bool undo) {
  int pool = nbytes <= kSmallBlock ? 2 : 1;
  stat_sub(st, nbytes, undo);
  stat_sub(st + pool * 4, nbytes, undo);
  stat_sub(st + 12, 1, undo);
  stat_sub(st + 12 + pool * 4, 1, undo);
}

// ---- the device allocator --------------------------------------------------------------------
// PyTorch's device-generic memory API (torch.accelerator.memory_allocated/memory_stats/
// reset_peak_memory_stats/empty_cache/get_memory_info) asks c10 for the device type's allocator and
// requires a DeviceAllocator. This one allocates through the same Python allocator as a storage
// resize (a counted block of device memory: torch.UntypedStorage(n, device="neuron") gets real
// memory) and answers the statistics from the ledger above, so torch.accelerator reads exactly the
// counters torch.neuron.memory_stats reads. There is no caching allocator behind the virtual HBM:
// emptyCache gives the host cache's kept blocks back (what torch.neuron.empty_cache does).

struct DeviceAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DeviceIndex index = t_device;
    c10::Device device(kNeuron, index);
    if (nbytes == 0) return c10::DataPtr(nullptr, nullptr, &release_block, device);
    TORCH_CHECK(g_alloc != nullptr, "neuron: allocating device memory needs the device's allocator (torch_bridge "
                "not registered)");
    void* ptr = nullptr;
    char error[512] = {0};
    int64_t token = g_alloc(index, static_cast<int64_t>(nbytes), &ptr, error, sizeof(error) - 1);
    TORCH_CHECK_WITH(OutOfMemoryError, token != 0, error);
    return c10::DataPtr(ptr, reinterpret_cast<void*>(token), &release_block, device);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override { host_release_all(); }
  void recordStream(const c10::DataPtr&, c10::Stream) override {}  // every neuron stream is the default one to torch

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_index(device);
    c10::CachingDeviceAllocator::DeviceStats out;
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    if (device >= static_cast<int>(g_pool.size())) return out;  // the device is not in use yet: nothing counted
    const int64_t* st = g_pool[device];
    // c10's pools are (aggregate, small, large); the ledger's are (all, large, small)
    constexpr int kPool[3] = {0, 2, 1};
    for (int t = 0; t < 3; ++t) {
      const int64_t* b = st + 4 * kPool[t];
      const int64_t* c = st + 12 + 4 * kPool[t];
      c10::CachingAllocator::Stat bytes{b[0], b[1], b[2], b[3]};
      c10::CachingAllocator::Stat count{c[0], c[1], c[2], c[3]};
      out.allocated_bytes[t] = out.reserved_bytes[t] = out.active_bytes[t] = out.requested_bytes[t] = bytes;
      out.allocation[t] = out.segment[t] = out.active[t] = count;
    }
    out.num_ooms = st[kOoms];
    out.num_device_alloc = st[12 + 2];
    out.num_device_free = st[12 + 3];
    out.max_split_size = -1;
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    if (device >= static_cast<int>(g_pool.size())) return;
    int64_t* st = g_pool[device];
    for (int s = 0; s < 24; s += 4) st[s + 2] = st[s + 3] = 0;
    st[kOoms] = 0;
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    if (device >= static_cast<int>(g_pool.size())) return;
    int64_t* st = g_pool[device];
    for (int s = 0; s < 24; s += 4) st[s + 1] = st[s];
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    if (device >= static_cast<int>(g_pool.size())) return {0, 0};
    const int64_t* st = g_pool[device];
    return {static_cast<size_t>(st[kCapacity] - st[0]), static_cast<size_t>(st[kCapacity])};
  }
};
DeviceAllocator g_device_allocator;

// ---- the fast path's blocks: device memory a fast-path op result owns -------------------------
// The CPU tensor the op computed stays alive inside the block (as a relabelled tensor's DLPack
// capsule keeps its CPU tensor); the neuron storage's deleter releases the bytes and the block.
struct FastBlock {
  at::Tensor cpu;
  int index;
  int64_t nbytes;
  FastBlock* prev = nullptr;
  FastBlock* next = nullptr;
};
FastBlock* g_blocks = nullptr;  // live blocks (memory_summary lists them), under g_mem_mutex
std::atomic<int> g_history{0};  // memory history records: allocations take the Python path
struct FreedBlock {
  int64_t index, addr, nbytes, time_us;
};
std::vector<FreedBlock>& g_freed = *new std::vector<FreedBlock>();  // frees of fast blocks while history records (Python drains them)

void fast_free(void* ctx) {
  auto* b = static_cast<FastBlock*>(ctx);
  {
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    if (b->prev) b->prev->next = b->next; else g_blocks = b->next;
    if (b->next) b->next->prev = b->prev;
    if (b->index < static_cast<int>(g_pool.size())) mem_sub_locked(g_pool[b->index], b->nbytes, false);
    if (g_history.load()) {
      auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                    std::chrono::system_clock::now().time_since_epoch()).count();
      g_freed.push_back({b->index, reinterpret_cast<int64_t>(b->cpu.storage().data()), b->nbytes, us});
    }
  }
  delete b;
}

// ---- the launch log ---------------------------------------------------------------------------
// What the fast path did, in order, for the device model (trnsim.device.Device) to issue exactly
// as if Python had launched it: (kind, core, id) with kind 0 a launch of cost handle `id`, kind 1
// a metadata-only op named `id`, kind -1 the host waiting for core `core`'s work (an item(): what
// Device.synchronize(core) does, taken in its place in the log), kind 2 + token a launch made inside
// graph capture `token`, kind -2 the end of capture `core` (its launches are issued there, or dropped
// where `id` is 0, a muted block's: trnsim_log_close). Python drains it (under the device's lock) before it launches
// anything itself or reads any time, so nothing sees the device's state with launches missing.
constexpr int64_t kLogMax = 1 << 15;
std::mutex g_log_mutex;
std::vector<int64_t> g_log;  // 3 int64 per entry
std::atomic<int64_t> g_log_count{0};  // entries in the log (Python reads it in place)

// The calling thread's graph capture (trnsim.device.Device.graph/muted; 0: none), set by Python
// on entering and leaving one: a launch made inside it is logged as kind 2 + the capture's token,
// so the device collects it into that capture, in order, rather than issuing it.
thread_local int64_t t_capture = 0;

// Host ops counted by name id in first-use order, as the log's bulk readers hand them to Python:
// (name id, count) pairs. (Distinct names are op names: far fewer than the buffers' kLogMax pairs.)
struct HostOpCounts {
  std::unordered_map<int64_t, size_t> at;
  std::vector<int64_t> pairs;
  void add(int64_t id) {
    auto it = at.find(id);
    if (it == at.end()) {
      at.emplace(id, pairs.size());
      pairs.push_back(id);
      pairs.push_back(1);
    } else {
      pairs[it->second + 1] += 1;
    }
  }
  int64_t write(int64_t* out) const {  // the pairs into `out`; returns how many
    std::memcpy(out, pairs.data(), pairs.size() * sizeof(int64_t));
    return static_cast<int64_t>(pairs.size() / 2);
  }
};

int64_t g_log_closes = 0;  // kind -2 entries in the log (under g_log_mutex)
// captures that learn their host ops (Device.recorded: not counted), under g_log_mutex; a host op made
// inside any other capture counts as one made outside it (Device._drain's loop), so the natively
// handled prefixes need not stop at it
std::unordered_set<int64_t>& g_learning = *new std::unordered_set<int64_t>();

// the log's first n entries gone (under g_log_mutex)
void erase_log_locked(int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if (g_log[3 * j] == -2) --g_log_closes;
  }
  g_log.erase(g_log.begin(), g_log.begin() + 3 * n);
  g_log_count.store(static_cast<int64_t>(g_log.size() / 3));
}

void log_entry(int64_t kind, int64_t core, int64_t id) {
  if (kind == 0 && t_capture != 0) kind = 2 + t_capture;
  std::lock_guard<std::mutex> lock(g_log_mutex);
  g_log.push_back(kind);
  g_log.push_back(core);
  g_log.push_back(id);
  g_log_count.store(static_cast<int64_t>(g_log.size() / 3));
}

// item()'s two entries (its launch, then the host's wait for `core`) under one lock: log_entry(0, ..)
// then log_entry(-1, core, 0), outside a capture (fast_item runs only there)
void log_launch_and_wait(int64_t core, int64_t id) {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  const int64_t entries[6] = {0, core, id, -1, core, 0};
  g_log.insert(g_log.end(), entries, entries + 6);
  g_log_count.store(static_cast<int64_t>(g_log.size() / 3));
}

// ---- the fast path ----------------------------------------------------------------------------
// The common eager op without Python: every tensor argument strided on one neuron device (or a
// 0-dim host scalar), no out=, no generator, not a view of its result. Its CPU kernel runs on
// CPU aliases of the arguments' memory, a fresh result is counted against HBM and becomes a neuron
// tensor over the same memory, and the launch of the op's cached cost (looked up by the op and
// its arguments' signature: shapes, dtypes, devices, ints, bools, strings; not float values, as
// Python's key) is logged. Anything else - a signature not seen yet (Python costs it, then teaches
// the handle here), an error, an odd result, memory history, torch.profiler, a graph capture,
// adaptive eager, a launch context, a stream other than the default - runs the Python fallback
// (torch_bridge.values), registered on PrivateUse2 for this redispatch.
// kWrites: in-place, out=; kMm/kAddmm/kBmm: the TensorE ops whose values the datapath computes
enum OpKind { kOther = 0, kView = 1, kFunctional = 2, kWrites = 3, kMm = 4, kAddmm = 5, kBmm = 6, kEmpty = 7,
               kEmptyStrided = 8, kCopyFrom = 9, kLstmCell = 10, kLstmCellBackward = 11,
               kGruCell = 12, kGruCellBackward = 13, kConv = 14,
               kConvBackward = 15, kBatchNorm = 16, kToCopy = 17, kLocalScalar = 18 };
struct OpFast {
  OpKind kind = kOther;
  int64_t name_id = -1;  // the op's name (its overload packet's, as Python's reports show it)
  // an in-place `_foreach_*_`: each element of the written list has its version counter bumped,
  // as CPU's kernel (the composite's loop of per-tensor in-place ops) bumps it (see fast_kernel)
  bool bump_list = false;
  // the native batch norms: their weight, bias and statistics are the arguments from this position on
  // (0: not one of them), which batch_norm_plain checks before CPU's kernel may run
  size_t params_from = 0;
};
std::mutex g_fast_mutex;
std::unordered_map<const c10::FunctionSchema*, OpFast> g_ops;
std::vector<std::string> g_names;
std::unordered_map<std::string, int64_t> g_costs;  // signature -> Python's cost handle
std::unordered_map<std::string, std::vector<int64_t>> g_cost_lists;  // signature -> handles, one per launch
std::atomic<int> g_fast_master{0};  // the fast path is on (Python: TRNSIM_FASTPATH, tests)
std::atomic<int> g_fast_launch{0};  // launches may be logged (the device model's gate)
std::atomic<int64_t> g_fast_hits{0};
// This thread is inside torch.compile's trace (Python sets it when dynamo's TracingContext is entered
// or left: torch_bridge._torch.watch_tracing). Kernels run then - constants dynamo or the fake mode
// evaluate for real - are the compiler's, not the program's: Python's path runs them and charges
// nothing (runtime.charge's rule); served here, a signature eager code had taught was charged.
thread_local int t_tracing = 0;

bool tracing() {
  return t_tracing != 0 ||
         c10::impl::TorchDispatchModeTLS::get_mode(c10::impl::TorchDispatchModeKey::FAKE).has_value();
}

struct Learn {
  const c10::OperatorHandle* op = nullptr;
  std::string key;
  int64_t handle = -1;
  std::vector<int64_t> many;  // an op Python charges as several launches (trnsim_fast_learn_many), in order
};
thread_local Learn* t_learn = nullptr;

const std::unordered_set<std::string>& denied() {
  static const std::unordered_set<std::string> names{
      "native_dropout", "set_", "is_set_to", "record_stream", "item", "resize_",
      "resize_as_", "copy_", "_copy_from", "_copy_from_and_resize", "_to_copy", "empty", "empty_strided",
      // writes its running_mean/running_var in training without saying so in its schema (no `(a!)`): read
      // as a functional op, its first call ran the CPU kernel here and again in Python's path to learn the
      // cost, so the running statistics moved twice (BatchNorm's first training step; fresh processes only).
      // fast_batch_norm serves it (kBatchNorm, classified before this list is read)
      "native_batch_norm",
      // CPU's cov centres a 0-dim input in place (self becomes 0) without an annotation: found by
      // difftest --write-guard 5 --seed 2412397 (cov 35713836657508); written once, as on CPU, in Python's path
      "cov"};
  return names;
}

// Overloads ("name.overload", the default one "name.") whose arguments Python's path screens before CPU's
// kernel may run (values._REFUSED_ARGS: lcm and truncating division of the integer minimum kill the
// process, Legendre and Laguerre polynomials of a huge degree run for centuries), set once by Python
// (trnsim_fast_screen) before any op is classified: the fast path leaves them to Python.
std::unordered_set<std::string>& screened() {
  static auto& names = *new std::unordered_set<std::string>();
  return names;
}

bool is_tensor_list(const c10::TypePtr& t) {
  return t->kind() == c10::TypeKind::ListType && t->containedType(0)->kind() == c10::TypeKind::TensorType;
}

// `Tensor?[]` (index.Tensor's indices), by the type's structure: Type::str() builds the name through a
// stringstream, which on every call with a list argument (cat, stack, the _foreach_ ops) took ~1 us
bool is_optional_tensor_list(const c10::TypePtr& t) {
  if (t->kind() != c10::TypeKind::ListType) return false;
  const c10::TypePtr& e = t->containedType(0);
  return e->kind() == c10::TypeKind::OptionalType && e->containedType(0)->kind() == c10::TypeKind::TensorType;
}

// A `_foreach_*` op is served when it is in-place: its first argument the one written tensor list
// (`Tensor(a!)[] self`), nothing returned (AdamW's mul_/lerp_/addcmul_/addcdiv_, clipping's mul_);
// or functional: nothing written, one fresh Tensor[] returned (Adam's _foreach_sqrt, clipping's
// _foreach_norm), each result counted and adopted as a single op's results are. out= ones have
// Python resize their outs; _foreach_copy_ takes host tensors beside device ones. Those stay Python's.
OpFast classify_foreach(const c10::FunctionSchema& s, OpFast f) {
  const auto& args = s.arguments();
  if (args.empty() || s.name() == "aten::_foreach_copy_" || s.name() == "aten::_foreach_copy") return f;
  if (s.returns().size() == 1 && is_tensor_list(s.returns()[0].type()) && s.returns()[0].alias_info() == nullptr) {
    for (const auto& a : args) {
      if (a.alias_info() != nullptr || a.type()->str().find("Generator") != std::string::npos) return f;
    }
    f.kind = kFunctional;
    return f;
  }
  if (!s.returns().empty()) return f;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* ai = args[i].alias_info();
    bool written = ai != nullptr && ai->isWrite();
    if (written != (i == 0)) return f;
    if (written && (args[i].kwarg_only() || !is_tensor_list(args[i].type()))) return f;
    if (args[i].type()->str().find("Generator") != std::string::npos) return f;
  }
  f.kind = kWrites;
  f.bump_list = true;
  return f;
}

OpFast classify(const c10::OperatorHandle& op) {
  const auto& s = op.schema();
  OpFast f;
  std::string name = s.name();
  auto colon = name.find("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  f.name_id = static_cast<int64_t>(g_names.size());
  g_names.push_back(name);
  if (name == "empty" && s.overload_name() == "memory_format") f.kind = kEmpty;
  if (name == "empty_strided" && s.overload_name().empty()) f.kind = kEmptyStrided;
  if (name == "_copy_from" && s.overload_name().empty()) f.kind = kCopyFrom;
  if (name == "_thnn_fused_lstm_cell" && s.overload_name().empty()) f.kind = kLstmCell;
  if (name == "_thnn_fused_lstm_cell_backward_impl" && s.overload_name().empty()) f.kind = kLstmCellBackward;
  if (name == "_thnn_fused_gru_cell" && s.overload_name().empty()) f.kind = kGruCell;
  if (name == "_thnn_fused_gru_cell_backward" && s.overload_name().empty()) f.kind = kGruCellBackward;
  if (name == "convolution_overrideable" && s.overload_name().empty()) f.kind = kConv;
  if (name == "convolution_backward_overrideable" && s.overload_name().empty()) f.kind = kConvBackward;
  if (name == "native_batch_norm" && s.overload_name().empty()) f.kind = kBatchNorm;  // (not as a functional op: below)
  if (name == "_to_copy" && s.overload_name().empty()) f.kind = kToCopy;
  if (name == "_local_scalar_dense" && s.overload_name().empty()) f.kind = kLocalScalar;
  if (f.kind != kOther) return f;
  if (name == "set_") {  // metadata only, as Python's fallback treats it (values._OpInfo.is_view): a host op
    f.kind = kView;
    return f;
  }
  if (name == "native_batch_norm_backward" || name == "batch_norm_backward") f.params_from = 2;
  if (name == "_native_batch_norm_legit" || name == "_native_batch_norm_legit_no_training") f.params_from = 1;
  if (denied().count(name) || screened().count(name + "." + s.overload_name())) return f;
  if (name.rfind("_foreach_", 0) == 0) return classify_foreach(s, f);
  if (s.overload_name().empty() && (name == "mm" || name == "addmm" || name == "bmm")) {
    f.kind = name == "mm" ? kMm : name == "addmm" ? kAddmm : kBmm;
    return f;
  }
  bool view = false, ret_write = false, ret_tensor = !s.returns().empty();
  for (const auto& r : s.returns()) {
    if (r.alias_info() != nullptr) (r.alias_info()->isWrite() ? ret_write : view) = true;
    if (r.type()->kind() != c10::TypeKind::TensorType) ret_tensor = false;
  }
  if (view) {
    f.kind = kView;
    return f;
  }
  int writes = 0;
  for (size_t i = 0; i < s.arguments().size(); ++i) {
    const auto& a = s.arguments()[i];
    std::string t = a.type()->str();
    if (t.find("Generator") != std::string::npos) return f;
    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) {
      if (t != "Tensor") return f;
      ++writes;
    }
  }
  if (!ret_tensor) return f;
  bool all_write = true;
  for (const auto& r : s.returns()) all_write = all_write && r.alias_info() != nullptr;
  if (writes == 0 && !ret_write) f.kind = kFunctional;
  else if (writes >= 1 && all_write && s.returns().size() <= static_cast<size_t>(writes)) f.kind = kWrites;
  return f;
}

// Entries are never changed or removed once made, so each thread keeps its own copy of what it
// has looked up (no lock on the way of every op).
const OpFast& op_fast(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::FunctionSchema*, const OpFast*> mine;
  auto hit = mine.find(&op.schema());
  if (hit != mine.end()) return *hit->second;
  std::lock_guard<std::mutex> lock(g_fast_mutex);
  auto it = g_ops.find(&op.schema());
  if (it == g_ops.end()) it = g_ops.emplace(&op.schema(), classify(op)).first;
  mine.emplace(&op.schema(), &it->second);
  return it->second;
}

int64_t cost_handle(const std::string& key) {
  thread_local std::unordered_map<std::string, int64_t> mine;
  auto hit = mine.find(key);
  if (hit != mine.end()) return hit->second;
  std::lock_guard<std::mutex> lock(g_fast_mutex);
  auto it = g_costs.find(key);
  if (it == g_costs.end()) return -1;
  mine.emplace(key, it->second);
  return it->second;
}

// the launches Python charged for `key`, in order (nullptr: not learnt yet); entries are never removed
const std::vector<int64_t>* cost_handles(const std::string& key) {
  thread_local std::unordered_map<std::string, const std::vector<int64_t>*> mine;
  auto hit = mine.find(key);
  if (hit != mine.end()) return hit->second;
  std::lock_guard<std::mutex> lock(g_fast_mutex);
  auto it = g_cost_lists.find(key);
  if (it == g_cost_lists.end()) return nullptr;
  mine.emplace(key, &it->second);
  return &it->second;
}

void key_int(std::string& k, int64_t v) { k.append(reinterpret_cast<const char*>(&v), sizeof(v)); }

// an int[] argument as the generic path keys it: its kind, length and values
void key_int_list(std::string& k, c10::ArrayRef<int64_t> l) {
  key_int(k, 7);
  key_int(k, static_cast<int64_t>(l.size()));
  for (int64_t v : l) key_int(k, v);
}

void key_tensor(std::string& k, const at::Tensor& t, int64_t device_class) {
  key_int(k, 100 + device_class);
  key_int(k, static_cast<int64_t>(t.scalar_type()));
  key_int(k, t.dim());
  for (auto d : t.sizes()) key_int(k, d);
}

void slow(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  HostScope host;  // (the Python path's CPU results become neuron tensors too)
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse2), stack);
}

// Python's cost for `key`: run the Python path, which teaches the handle it charged.
void learn(const c10::OperatorHandle& op, torch::jit::Stack* stack, std::string key) {
  Learn mine;
  mine.op = &op;
  mine.key = std::move(key);
  Learn* prev = t_learn;
  t_learn = &mine;
  try {
    slow(op, stack);
  } catch (...) {
    t_learn = prev;
    throw;
  }
  t_learn = prev;
  if (!mine.many.empty()) {
    std::lock_guard<std::mutex> lock(g_fast_mutex);
    g_cost_lists.emplace(std::move(mine.key), std::move(mine.many));
  } else if (mine.handle >= 0) {
    std::lock_guard<std::mutex> lock(g_fast_mutex);
    g_costs.emplace(std::move(mine.key), mine.handle);
  }
}

// The CPU aliases one call makes share a CPU storage wherever their neuron tensors share memory (the
// same address and size, as memory.cpu_view's storages are keyed in Python): a CPU kernel's overlap
// checks (TensorIterator's partial-overlap error for an out= or copy_ whose destination overlaps a
// source, index ops' no-overlap checks) compare storages, and one storage per alias hid every overlap
// from them, so a call CPU refuses computed a value. A scope lives for one call on this thread; an
// alias made outside any scope gets a storage of its own.
struct AliasScope {
  c10::SmallVector<std::pair<std::pair<const void*, size_t>, c10::Storage>, 6> storages;
  AliasScope* prev;
  static AliasScope*& current() {
    thread_local AliasScope* scope = nullptr;
    return scope;
  }
  AliasScope() : prev(current()) { current() = this; }
  ~AliasScope() { current() = prev; }
  AliasScope(const AliasScope&) = delete;
  AliasScope& operator=(const AliasScope&) = delete;
};

// The bytes of its storage a strided tensor's elements reach (0 for an empty tensor). A tensor whose
// storage holds fewer - one whose memory `untyped_storage().resize_(0)` freed, as FSDP2 frees its
// unsharded parameters - has no memory to read or write: its CPU alias read freed or foreign memory
// (garbage values from .cpu(), .tolist(), copy_, mm; a crash from add) where CPU refuses or crashes.
int64_t reach_bytes(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return (last + 1) * static_cast<int64_t>(t.itemsize());
}

bool within_storage(const at::Tensor& t) {
  return static_cast<int64_t>(t.storage().nbytes()) >= reach_bytes(t);
}

// memory.cpu_view's refusal, in the same words
void check_within_storage(const at::Tensor& t) {
  TORCH_CHECK(within_storage(t), "neuron: a tensor of ", t.numel(), " elements over ", t.storage().nbytes(),
              " bytes of memory (it needs ", reach_bytes(t),
              "): its storage was freed or shrunk (untyped_storage().resize_()); re-allocate it "
              "(untyped_storage().resize_(n)) before using the tensor");
}

at::Tensor cpu_alias(const at::Tensor& t) {
  check_within_storage(t);
  const c10::Storage& st = t.storage();
  std::pair<const void*, size_t> where(st.data(), st.nbytes());
  AliasScope* scope = AliasScope::current();
  c10::Storage cs;
  if (scope != nullptr && where.first != nullptr) {
    for (const auto& s : scope->storages) {
      if (s.first == where) cs = s.second;
    }
  }
  if (!cs) {
    cs = c10::Storage(c10::Storage::use_byte_size_t(), st.nbytes(),
                      c10::DataPtr(st.mutable_data(), c10::Device(c10::kCPU)), nullptr, false);
    if (scope != nullptr && where.first != nullptr) scope->storages.emplace_back(where, cs);
  }
  auto cpu = at::detail::make_tensor<c10::TensorImpl>(std::move(cs), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                      t.dtype());
  cpu.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return cpu;
}

// `b` is counted and listed already (under the ledger's lock)
at::Tensor to_device(const at::Tensor& cpu, FastBlock* b, int index) {
  c10::Device dev(kNeuron, static_cast<c10::DeviceIndex>(index));
  c10::Storage st(c10::Storage::use_byte_size_t(), cpu.storage().nbytes(),
                  c10::DataPtr(cpu.storage().mutable_data(), b, &fast_free, dev), nullptr, false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(st), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                    cpu.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(cpu.sizes(), cpu.strides(), cpu.storage_offset());
  return t;
}

// ---- TensorE matmuls: mm, addmm, bmm on the datapath -----------------------------------------
// The values torch_bridge.values.mm/addmm/bmm compute, the same way: trnsim's C datapath
// (trn_matmul_batched, called with the arguments trnsim.native.matmul/matmul_batched pass it:
// the left operand read transposed as the stationary one, a fresh contiguous float32 result), and
// addmm's `alpha * prod + beta * self` by the same CPU kernels in the same order (a bfloat16/float16
// self upcast to float32 first, as values._add_scaled does), then a bfloat16/float16 product's float32
// PSUM result rounded to its dtype by the same `.to`. Operands of float32, bfloat16 or float16 (both of
// one dtype, and addmm's self too); anything else steps aside.
using BatchedFn = int (*)(const void*, int, int64_t, int64_t, int64_t, const void*, int, int64_t, int64_t, int64_t,
                          float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int,
                          int);
std::atomic<BatchedFn> g_batched{nullptr};  // trnsim.native.batched_entry()
std::atomic<int> g_f32_code{0}, g_fma_on{1};
std::atomic<int> g_f16_code{-1}, g_bf16_code{-1};  // datapath.h's float16 / bfloat16 codes (-1: not given)
std::atomic<int64_t> g_k_chunk{0};  // the chip's contraction rows per matmul instruction (config)
std::atomic<int64_t> g_datapath_ns{0};  // wall time in the datapath (the training benchmark reports it)

std::string env_text(const char* name, bool* set) {
  const char* raw = std::getenv(name);
  *set = raw != nullptr;
  std::string s = raw ? raw : "";
  size_t a = s.find_first_not_of(" \t\n\r\f\v"), b = s.find_last_not_of(" \t\n\r\f\v");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

// TRNSIM_NATIVE_THREADS as trnsim.native reads it: unset or blank 1, a plain 1..64; 0 for anything
// else (Python reads it then, and raises its error for a bad value)
int datapath_threads() {
  bool set = false;
  std::string s = env_text("TRNSIM_NATIVE_THREADS", &set);
  if (s.empty()) return 1;
  size_t i = s[0] == '+' ? 1 : 0;
  if (s.size() - i < 1 || s.size() - i > 2) return 0;
  int n = 0;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return 0;
    n = n * 10 + (s[i] - '0');
  }
  return n >= 1 && n <= 64 ? n : 0;
}

// The datapath's format code of a matmul operand's dtype (float32, bfloat16, float16: the ones
// torch_bridge.tensore.on_datapath takes), or -1.
int datapath_code(c10::ScalarType st) {
  switch (st) {
    case c10::kFloat: return g_f32_code.load();
    case c10::kBFloat16: return g_bf16_code.load();
    case c10::kHalf: return g_f16_code.load();
    default: return -1;
  }
}

bool matmul_operand(const at::Tensor& t, int64_t dim, int* index) {
  if (!t.defined() || t.device().type() != kNeuron || t.layout() != c10::kStrided || t.is_conj() || t.is_neg() ||
      datapath_code(t.scalar_type()) < 0 || t.dim() != dim || !within_storage(t)) {
    return false;  // (a tensor without its memory: Python's path refuses it)
  }
  int ti = t.device().index() < 0 ? 0 : t.device().index();
  if (*index < 0) *index = ti;
  return ti == *index;
}

const void* first_element(const at::Tensor& t) {
  return static_cast<const char*>(t.storage().data()) + t.storage_offset() * static_cast<int64_t>(t.itemsize());
}

void key_strides(std::string& key, const at::Tensor& t) {
  key_tensor(key, t, 0);
  for (auto st : t.strides()) key_int(key, st);  // the layout picks the kernel's operand forms
}

// The largest magnitude's bits of n contiguous 16- or 32-bit floats at p, sign bits cleared
// (`mask`: 0x7fff or 0x7fffffff): magnitudes' bits order as their values, and a NaN's cleared
// bits are above the infinity's, so one integer max says both (read through memcpy, an integer
// max the compiler vectorizes). The extension is built for any x86-64 (SSE2, which has no
// unsigned 32-bit max: its compare-and-blend chain made the finiteness scan 9% of an LSTM training
// step, whose weight gradients are big results of 8-deep contractions); GCC also compiles it for
// AVX2 and the loader picks the CPU's version.
template <typename U>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
__attribute__((optimize("O3"))) U top_bits(const void* p, int64_t n, U mask) {
  const char* bytes = static_cast<const char*>(p);
  U top = 0;
  for (int64_t i = 0; i < n; ++i) {
    U b;
    std::memcpy(&b, bytes + i * static_cast<int64_t>(sizeof(U)), sizeof b);
    b = static_cast<U>(b & mask);
    top = b > top ? b : top;
  }
  return top;
}

// True when none of the n floats at p is an infinity or a NaN (one pass over the result the
// datapath just wrote).
bool all_finite_f32(const float* p, int64_t n) { return top_bits(p, n, uint32_t{0x7fffffffu}) < 0x7f800000u; }

// The float32 PSUM result: host memory behind a neuron tensor, so it comes from the host cache
// (HostScope, above) like the fast path's other CPU results; c10's plain CPU allocator
// (posix_memalign) made each big result of the small GPT-2 fault its pages in again on every call
// (~130 faults per 12 MB result, measured, where the Python path's numpy arrays reused theirs).
at::Tensor psum_result(c10::IntArrayRef sizes) {
  HostScope host;
  return at::detail::empty_cpu(sizes, c10::kFloat);
}

// The datapath as the fast path calls it: its entry point (trnsim.native.batched_entry), the chip's
// contraction rows per instruction and the thread count. False when Python's route must decide:
// not registered, TRNSIM_NATIVE=0 (the numpy reference), a TRNSIM_NATIVE_THREADS Python refuses.
struct Datapath {
  BatchedFn fn = nullptr;
  int64_t k_chunk = 0;
  int threads = 0;
};

bool datapath_ready(Datapath* d) {
  d->fn = g_batched.load();
  d->k_chunk = g_k_chunk.load();
  d->threads = datapath_threads();
  bool native_set = false;
  return d->fn != nullptr && d->k_chunk >= 1 && d->threads != 0 && env_text("TRNSIM_NATIVE", &native_set) != "0";
}

// a [B,] M, K @ b [B,] K, N (dim 3 or 2, operands of the datapath format `code`) into the float32
// PSUM result `out` [B,] M, N, with the arguments trnsim.native.matmul/matmul_batched pass: the
// stationary operand is `a` read transposed ([B,] K, M), the moving one `b`. The datapath's status.
int datapath_matmul(const Datapath& d, const at::Tensor& a, const at::Tensor& b, int code, int64_t dim,
                    at::Tensor& out) {
  const int64_t B = dim == 3 ? a.size(0) : 1, M = a.size(dim - 2), K = a.size(dim - 1), N = b.size(dim - 1);
  const int64_t s_sb = dim == 3 ? a.stride(0) : 0, s_sk = a.stride(dim - 1), s_sm = a.stride(dim - 2);
  const int64_t v_sb = dim == 3 ? b.stride(0) : 0, v_sk = b.stride(dim - 2), v_sn = b.stride(dim - 1);
  auto t0 = std::chrono::steady_clock::now();
  int rc = d.fn(first_element(a), code, s_sb, s_sk, s_sm, first_element(b), code, v_sb, v_sk, v_sn,
                out.mutable_data_ptr<float>(), dim == 3 ? M * N : 0, N, 1, B, K, M, N, d.k_chunk, 0, -1,
                g_fma_on.load(), d.threads);
  g_datapath_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  return rc;
}

void fast_matmul(const c10::OperatorHandle& op, torch::jit::Stack* stack, OpKind kind) {
  Datapath dp;
  if (!datapath_ready(&dp)) return slow(op, stack);  // (TRNSIM_NATIVE=0: the numpy reference, Python's)
  const size_t n = op.schema().arguments().size();
  const size_t base = stack->size() - n;
  const size_t first = kind == kAddmm ? 1 : 0;
  const c10::IValue& va = (*stack)[base + first];
  const c10::IValue& vb = (*stack)[base + first + 1];
  if (!va.isTensor() || !vb.isTensor()) return slow(op, stack);
  const at::Tensor& a = va.toTensor();
  const at::Tensor& b = vb.toTensor();
  const int64_t dim = kind == kBmm ? 3 : 2;
  int index = -1;
  if (!matmul_operand(a, dim, &index) || !matmul_operand(b, dim, &index) || a.numel() == 0 || b.numel() == 0 ||
      b.scalar_type() != a.scalar_type()) {
    return slow(op, stack);
  }
  const c10::ScalarType dtype = a.scalar_type();
  const int code = datapath_code(dtype);
  const int64_t B = dim == 3 ? a.size(0) : 1, M = a.size(dim - 2), K = a.size(dim - 1), N = b.size(dim - 1);
  if (b.size(dim - 2) != K || (dim == 3 && b.size(0) != B)) return slow(op, stack);
  thread_local std::string t_key;
  std::string& key = t_key;
  key.clear();
  key_int(key, reinterpret_cast<int64_t>(&op.schema()));
  key_strides(key, a);
  key_strides(key, b);
  at::Tensor c;
  c10::Scalar alpha(1), beta(1);
  if (kind == kAddmm) {  // self broadcasts to [M, N]; beta, alpha real numbers
    const c10::IValue& vc = (*stack)[base];
    const c10::IValue& vbeta = (*stack)[base + 3];
    const c10::IValue& valpha = (*stack)[base + 4];
    if (!vc.isTensor() || !(vbeta.isDouble() || vbeta.isInt()) || !(valpha.isDouble() || valpha.isInt())) {
      return slow(op, stack);
    }
    c = vc.toTensor();
    if (!c.defined() || c.dim() > 2 || !matmul_operand(c, c.dim(), &index) || c.scalar_type() != dtype) {
      return slow(op, stack);
    }
    const int64_t rows[2] = {M, N};
    for (int64_t i = 0; i < c.dim(); ++i) {
      int64_t cs = c.size(c.dim() - 1 - i), rs = rows[1 - i];
      if (cs != 1 && cs != rs) return slow(op, stack);
    }
    key_strides(key, c);
    beta = vbeta.toScalar();
    alpha = valpha.toScalar();
    if (alpha.toDouble() == 0) return slow(op, stack);  // BLAS's alpha == 0: values.addmm reads self only
  }
  key_int(key, 53);
  int64_t handle = cost_handle(key);
  if (handle < 0) return learn(op, stack, key);
  at::Tensor out;
  try {
    out = dim == 3 ? psum_result({B, M, N}) : psum_result({M, N});
  } catch (...) {  // the host is out of memory: Python's path raises its own error
    return slow(op, stack);
  }
  if (datapath_matmul(dp, a, b, code, dim, out) != 0) return slow(op, stack);  // Python raises the datapath's error
  if (kind == kAddmm) {  // values._add_scaled, over the PSUM result
    if (alpha.toDouble() != 1) out.mul_(alpha);
    if (beta.toDouble() != 0) {  // beta == 0 ignores self entirely (even NaN), as aten does
      at::Tensor cc = cpu_alias(c);
      if (dtype != c10::kFloat) cc = cc.to(c10::kFloat);  // (values._add_scaled: self in fp32, then scaled)
      out.add_(beta.toDouble() == 1 ? cc : cc.mul(beta));
    }
  }
  // A result with an infinity or a NaN: Python's path decides (torch_bridge.tensore.bounded: it
  // takes CPU's kernel where products may overflow or inputs are not finite, whose +inf/-inf/NaN
  // the datapath's fused sums do not reproduce). Scanning the result, not the operands, keeps
  // small-batch matmuls cheap (an operand scan read the whole weight on every call); a product
  // that overflows always leaves a non-finite result on the datapath (fma keeps it exact, and an
  // infinite accumulator stays infinite or NaN), bar sums within 2x of float32's largest value.
  if (!all_finite_f32(out.const_data_ptr<float>(), out.numel())) return slow(op, stack);
  if (dtype != c10::kFloat) {  // the PSUM result rounded to the operands' dtype (values.mm: p.to(dtype))
    try {
      HostScope host;
      out = out.to(dtype);
    } catch (...) {
      return slow(op, stack);
    }
  }
  auto nbytes = static_cast<int64_t>(out.storage().nbytes());
  FastBlock* block = nullptr;
  {  // counted against HBM, or Python raises the OOM (and counts it)
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    if (index < static_cast<int>(g_pool.size())) {
      int64_t* st = g_pool[index];
      if (st[0] + nbytes <= st[kCapacity]) {
        mem_add_locked(st, nbytes);
        block = new FastBlock{out, index, nbytes};
        block->next = g_blocks;
        if (g_blocks) g_blocks->prev = block;
        g_blocks = block;
      }
    }
  }
  if (block == nullptr) return slow(op, stack);
  torch::jit::drop(*stack, n);
  stack->emplace_back(to_device(out, block, index));
  g_fast_hits++;
  log_entry(0, index, handle);
}

// ---- allocation and copies within the device ----------------------------------------------------
// `cpu` (a fresh host tensor) counted against HBM on core `index` as a fast block, or nullptr when
// it does not fit (Python's path then raises the OOM, and counts it).
FastBlock* count_block(const at::Tensor& cpu, int index) {
  auto nbytes = static_cast<int64_t>(cpu.storage().nbytes());
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  if (index >= static_cast<int>(g_pool.size())) return nullptr;
  int64_t* st = g_pool[index];
  if (st[0] + nbytes > st[kCapacity]) return nullptr;
  mem_add_locked(st, nbytes);
  auto* b = new FastBlock{cpu, index, nbytes};
  b->next = g_blocks;
  if (g_blocks) g_blocks->prev = b;
  g_blocks = b;
  return b;
}

// Count every defined tensor of `ts` against HBM on `index`, its block listed in `blocks` (nullptr
// for an undefined one), or none: false, and Python then raises the OOM (and counts it).
bool count_all(const at::Tensor* const* ts, size_t count, int index, FastBlock** blocks) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  if (index >= static_cast<int>(g_pool.size())) return false;
  int64_t* st = g_pool[index];
  int64_t need = 0;
  for (size_t i = 0; i < count; ++i) {
    if (ts[i]->defined()) need += static_cast<int64_t>(ts[i]->storage().nbytes());
  }
  if (st[0] + need > st[kCapacity]) return false;
  for (size_t i = 0; i < count; ++i) {
    blocks[i] = nullptr;
    if (!ts[i]->defined()) continue;
    auto nbytes = static_cast<int64_t>(ts[i]->storage().nbytes());
    mem_add_locked(st, nbytes);
    auto* b = blocks[i] = new FastBlock{*ts[i], index, nbytes};
    b->next = g_blocks;
    if (g_blocks) g_blocks->prev = b;
    g_blocks = b;
  }
  return true;
}

// undo count_block for a block not handed out (nullptr: nothing to undo)
void uncount_block(FastBlock* b, int index) {
  if (b == nullptr) return;
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  if (b->prev) b->prev->next = b->next; else g_blocks = b->next;
  if (b->next) b->next->prev = b->prev;
  mem_sub_locked(g_pool[index], b->nbytes, true);
  delete b;
}

bool fits(int index, int64_t nbytes) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  return index < static_cast<int>(g_pool.size()) && g_pool[index][0] + nbytes <= g_pool[index][kCapacity];
}

// empty.memory_format / empty_strided: what torch_bridge.alloc's kernels do (memory.allocate: host
// memory from the host cache, counted against HBM; no launch), for the common call: sizes and
// strides known, a strided layout, no pinning, a neuron device that exists (or the current one).
// Anything else - and an allocation that would not fit - takes Python's path and its errors.
void fast_empty(const c10::OperatorHandle& op, torch::jit::Stack* stack, OpKind kind) {
  const size_t n = op.schema().arguments().size();
  const size_t base = stack->size() - n;
  auto arg = [&](size_t i) -> const c10::IValue& { return (*stack)[base + i]; };
  const size_t opt = kind == kEmpty ? 1 : 2;  // dtype, layout, device, pin_memory[, memory_format]
  if (n != opt + 4 + (kind == kEmpty ? 1 : 0) || !arg(0).isIntList() || (kind == kEmptyStrided && !arg(1).isIntList())) {
    return slow(op, stack);
  }
  const c10::IValue& vdt = arg(opt);
  const c10::IValue& vlayout = arg(opt + 1);
  const c10::IValue& vdev = arg(opt + 2);
  const c10::IValue& vpin = arg(opt + 3);
  if (!(vlayout.isNone() || (vlayout.isInt() && vlayout.toInt() == static_cast<int64_t>(c10::kStrided)))) {
    return slow(op, stack);
  }
  if (!(vpin.isNone() || (vpin.isBool() && !vpin.toBool()))) return slow(op, stack);
  int index = t_device;
  if (!vdev.isNone()) {
    if (!vdev.isDevice() || vdev.toDevice().type() != kNeuron) return slow(op, stack);
    if (vdev.toDevice().index() >= 0) index = vdev.toDevice().index();
  }
  if (index < 0 || index >= g_device_count.load()) return slow(op, stack);
  c10::ScalarType dtype = c10::get_default_dtype_as_scalartype();
  if (!vdt.isNone()) {
    if (!vdt.isInt()) return slow(op, stack);
    dtype = static_cast<c10::ScalarType>(vdt.toInt());
  }
  std::optional<c10::MemoryFormat> fmt;
  if (kind == kEmpty && !arg(opt + 4).isNone()) {
    if (!arg(opt + 4).isInt()) return slow(op, stack);
    fmt = static_cast<c10::MemoryFormat>(arg(opt + 4).toInt());
    if (*fmt != c10::MemoryFormat::Contiguous && *fmt != c10::MemoryFormat::ChannelsLast &&
        *fmt != c10::MemoryFormat::ChannelsLast3d) {
      return slow(op, stack);  // (preserve: CPU's refusal, in Python's words)
    }
  }
  std::vector<int64_t> size = arg(0).toIntVector();
  std::vector<int64_t> stride;
  if (kind == kEmptyStrided) stride = arg(1).toIntVector();
  for (int64_t d : size) {
    if (d < 0) return slow(op, stack);
  }
  if (kind == kEmptyStrided) {
    if (stride.size() != size.size()) return slow(op, stack);
    for (int64_t d : stride) {
      if (d < 0) return slow(op, stack);
    }
  }
  int64_t nbytes;
  try {
    nbytes = kind == kEmpty ? static_cast<int64_t>(c10::multiply_integers(size) * c10::elementSize(dtype))
                            : static_cast<int64_t>(at::detail::computeStorageNbytes(size, stride, c10::elementSize(dtype)));
  } catch (...) {
    return slow(op, stack);
  }
  if (!fits(index, nbytes)) return slow(op, stack);  // (checked before the host backs it, as Python does)
  at::Tensor cpu;
  try {
    HostScope host;
    cpu = kind == kEmpty ? at::detail::empty_cpu(size, dtype, false, fmt)
                         : at::detail::empty_strided_cpu(size, stride, dtype, false);
  } catch (...) {
    return slow(op, stack);
  }
  FastBlock* block = count_block(cpu, index);
  if (block == nullptr) return slow(op, stack);
  torch::jit::drop(*stack, n);
  stack->emplace_back(to_device(cpu, block, index));  // (an allocation, not an op: no hit counted)
}

// _copy_from(self, dst, non_blocking) within one neuron device, or from the host to it: what
// torch_bridge.alloc.copy_from does (the CPU copy over the aliases, one launch of copy_d2d or
// copy_h2d costed by the sizes and dtypes). A copy to the host makes the host wait for the device:
// Python's (it is the device model's).
void fast_copy(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const size_t base = stack->size() - n;
  if (n != 3) return slow(op, stack);
  const c10::IValue& vs = (*stack)[base];
  const c10::IValue& vd = (*stack)[base + 1];
  const c10::IValue& vnb = (*stack)[base + 2];
  if (!vs.isTensor() || !vd.isTensor() || !vnb.isBool()) return slow(op, stack);
  const at::Tensor& src = vs.toTensor();
  const at::Tensor& dst = vd.toTensor();
  if (!src.defined() || !dst.defined() || dst.device().type() != kNeuron || dst.layout() != c10::kStrided ||
      src.layout() != c10::kStrided || dst.is_conj() || dst.is_neg()) {
    return slow(op, stack);
  }
  const int index = dst.device().index() < 0 ? 0 : dst.device().index();
  const bool from_device = src.device().type() == kNeuron;
  if (from_device) {
    if ((src.device().index() < 0 ? 0 : src.device().index()) != index || src.is_conj() || src.is_neg()) {
      return slow(op, stack);
    }
  } else if (!src.device().is_cpu()) {
    return slow(op, stack);
  }
  thread_local std::string t_key;
  std::string& key = t_key;
  key.clear();
  key_int(key, reinterpret_cast<int64_t>(&op.schema()));
  key_tensor(key, src, from_device ? 0 : 1);
  key_tensor(key, dst, 0);
  key_int(key, 50);
  int64_t handle = cost_handle(key);
  if (handle < 0) return learn(op, stack, key);
  try {
    HostScope host;
    at::Tensor d = cpu_alias(dst);
    d.copy_(from_device ? cpu_alias(src) : src);
  } catch (...) {
    return slow(op, stack);  // (a copy checks its arguments before it writes: Python raises it)
  }
  c10::IValue out = vd;
  torch::jit::drop(*stack, n);
  stack->push_back(std::move(out));
  g_fast_hits++;
  log_entry(0, index, handle);
}

// _to_copy(self, *, dtype, layout, device, pin_memory, non_blocking, memory_format) within one
// neuron device (Tensor.to(dtype), .float(), .half(), ...): what torch_bridge.alloc.to_copy does, the
// same two ops called the same way - empty_like in the new dtype and memory format, then copy_ -
// each served (or stepped aside) by the dispatcher as when Python calls them: fast_empty, then
// fast_copy's one copy_d2d launch. What it saves is the Python kernel around them (~6 us a call:
// 248 calls in a bfloat16 Llama generate() step, its RMSNorms' upcasts). A copy to or from the host
// (pinned or non-blocking memory), another device, a layout other than strided: Python's.
void fast_to_copy(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const size_t base = stack->size() - n;
  auto arg = [&](size_t i) -> const c10::IValue& { return (*stack)[base + i]; };
  if (n != 7 || !arg(0).isTensor()) return slow(op, stack);
  const at::Tensor& self = arg(0).toTensor();
  if (!self.defined() || self.device().type() != kNeuron || self.layout() != c10::kStrided || self.is_conj() ||
      self.is_neg()) {
    return slow(op, stack);
  }
  const c10::IValue &vdt = arg(1), &vlayout = arg(2), &vdev = arg(3), &vpin = arg(4), &vnb = arg(5), &vfmt = arg(6);
  if (!(vdt.isNone() || vdt.isInt()) || !(vlayout.isNone() || (vlayout.isInt() &&
      vlayout.toInt() == static_cast<int64_t>(c10::kStrided))) || !(vpin.isNone() || (vpin.isBool() && !vpin.toBool())) ||
      !vnb.isBool() || !(vfmt.isNone() || vfmt.isInt())) {
    return slow(op, stack);
  }
  if (!vdev.isNone()) {  // self's own device, by index ("neuron" alone means the current one: Python's)
    if (!vdev.isDevice()) return slow(op, stack);
    const c10::Device d = vdev.toDevice();
    if (d.type() != kNeuron || d.index() < 0 || d.index() != self.device().index()) return slow(op, stack);
  }
  const c10::ScalarType dtype = vdt.isNone() ? self.scalar_type() : static_cast<c10::ScalarType>(vdt.toInt());
  const c10::MemoryFormat fmt = vfmt.isNone() ? c10::MemoryFormat::Preserve
                                              : static_cast<c10::MemoryFormat>(vfmt.toInt());
  // (an error in either op is raised as Python's to_copy would raise it: the same op's error)
  at::Tensor out = at::empty_like(self, self.options().dtype(dtype), fmt);
  out.copy_(self, vnb.toBool());
  torch::jit::drop(*stack, n);
  stack->emplace_back(std::move(out));
}

// ---- LSTM cells ----------------------------------------------------------------------------------
// nn.LSTM's and nn.GRU's gates off CPU: _thnn_fused_lstm_cell, _thnn_fused_gru_cell and their backwards, which CPU has no kernel for.
// torch_bridge/cells.py defines their values (CUDA's, in float32 for 16-bit inputs); these are the
// same CPU ops in the same order on the arguments' aliases, so the same bits, with no Python on
// the way. The cost is Python's (host_kernel teaches the handle for the call's signature).
std::vector<at::Tensor> lstm_cell_values(const std::vector<at::Tensor>& a) {  // cells._lstm_cell
  const at::Tensor &ig = a[0], &hg = a[1], &cx = a[2], &ib = a[3], &hb = a[4];
  auto dt = ig.scalar_type();
  at::Tensor gates = ig.to(at::kFloat) + hg.to(at::kFloat);
  if (ib.defined()) gates = gates + ib.to(at::kFloat) + hb.to(at::kFloat);
  auto ch = gates.chunk(4, 1);
  at::Tensor i = ch[0].sigmoid(), f = ch[1].sigmoid(), g = ch[2].tanh(), o = ch[3].sigmoid();
  at::Tensor cy = f * cx.to(at::kFloat) + i * g;
  at::Tensor hy = o * cy.tanh();
  at::Tensor workspace = at::cat({i, f, g, o}, 1);
  return {hy.to(dt), cy.to(dt), workspace.to(dt)};
}

std::vector<at::Tensor> lstm_cell_backward_values(const std::vector<at::Tensor>& a, bool has_bias) {
  const at::Tensor &grad_hy = a[0], &grad_cy = a[1], &cx = a[2], &cy = a[3], &workspace = a[4];
  auto dt = workspace.scalar_type();  // cells._lstm_cell_backward
  auto ch = workspace.to(at::kFloat).chunk(4, 1);
  const at::Tensor &i = ch[0], &f = ch[1], &g = ch[2], &o = ch[3];
  at::Tensor zeros = at::zeros(cx.sizes(), at::TensorOptions().dtype(at::kFloat));
  at::Tensor go = grad_hy.defined() ? grad_hy.to(at::kFloat) : zeros;
  at::Tensor gcy = grad_cy.defined() ? grad_cy.to(at::kFloat) : zeros;
  at::Tensor tcy = cy.to(at::kFloat).tanh();
  at::Tensor gog = go * tcy;
  at::Tensor gc = go * o * at::rsub(tcy * tcy, 1) + gcy;
  at::Tensor gig = gc * g * i * at::rsub(i, 1);
  at::Tensor gfg = gc * cx.to(at::kFloat) * f * at::rsub(f, 1);
  at::Tensor gcg = gc * i * at::rsub(g * g, 1);
  gog = gog * o * at::rsub(o, 1);
  at::Tensor grad_gates = at::cat({gig, gfg, gcg, gog}, 1);
  at::Tensor grad_cx = gc * f;
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0).to(dt) : at::Tensor();
  return {grad_gates.to(dt), grad_cx.to(dt), grad_bias};
}

std::vector<at::Tensor> gru_cell_values(const std::vector<at::Tensor>& a) {  // cells._gru_cell
  const at::Tensor &hx = a[2], &ib = a[3], &hb = a[4];
  auto dt = a[0].scalar_type();
  at::Tensor ig = a[0].to(at::kFloat), hg = a[1].to(at::kFloat);
  if (ib.defined()) {
    ig = ig + ib.to(at::kFloat);
    hg = hg + hb.to(at::kFloat);
  }
  auto ic = ig.chunk(3, 1), hc = hg.chunk(3, 1);
  at::Tensor r = (ic[0] + hc[0]).sigmoid();
  at::Tensor z = (ic[1] + hc[1]).sigmoid();
  at::Tensor n = (ic[2] + r * hc[2]).tanh();
  at::Tensor h = hx.to(at::kFloat);
  at::Tensor hy = n + z * (h - n);
  at::Tensor workspace = at::cat({r, z, n, h, hc[2]}, 1);
  return {hy.to(dt), workspace.to(dt)};
}

std::vector<at::Tensor> gru_cell_backward_values(const std::vector<at::Tensor>& a, bool has_bias) {
  const at::Tensor &grad_hy = a[0], &workspace = a[1];
  auto dt = workspace.scalar_type();  // cells._gru_cell_backward
  auto ch = workspace.to(at::kFloat).chunk(5, 1);
  const at::Tensor &r = ch[0], &z = ch[1], &n = ch[2], &h = ch[3], &hn = ch[4];
  at::Tensor go = grad_hy.to(at::kFloat);
  at::Tensor gz = go * (h - n) * at::rsub(z, 1) * z;
  at::Tensor ghx = go * z;
  at::Tensor gn = go * at::rsub(z, 1) * at::rsub(n * n, 1);
  at::Tensor ghn = gn * r;
  at::Tensor gr = gn * hn * at::rsub(r, 1) * r;
  at::Tensor grad_input = at::cat({gr, gz, gn}, 1);
  at::Tensor grad_hidden = at::cat({gr, gz, ghn}, 1);
  at::Tensor gib = has_bias ? grad_input.sum(0).to(dt) : at::Tensor();
  at::Tensor ghb = has_bias ? grad_hidden.sum(0).to(dt) : at::Tensor();
  return {grad_input.to(dt), grad_hidden.to(dt), ghx.to(dt), gib, ghb};
}

// ---- shared by the fast kernels that take a fixed list of tensor arguments -----------------------
// The `count` tensor arguments from stack[base]: each None (keyed 6), undefined (keyed 1) or a
// strided neuron tensor without conj/neg bits on the one device they all share (keyed by dtype and
// sizes, and strides too with `strides`), its memory noted in `inputs`, its CPU alias in cpu[i].
// False: Python's path takes the call (two devices: its error).
bool tensor_args(const torch::jit::Stack& s, size_t base, size_t count, std::string& key, bool strides, int* index,
                 at::Tensor* cpu, c10::SmallVectorImpl<const void*>& inputs) {
  for (size_t i = 0; i < count; ++i) {
    const c10::IValue& v = s[base + i];
    if (v.isNone()) {
      key_int(key, 6);
      continue;
    }
    if (!v.isTensor()) return false;
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      key_int(key, 1);
      continue;
    }
    if (t.device().type() != kNeuron || t.layout() != c10::kStrided || t.is_conj() || t.is_neg()) return false;
    int ti = t.device().index() < 0 ? 0 : t.device().index();
    if (*index < 0) *index = ti;
    else if (ti != *index) return false;
    if (strides) key_strides(key, t);
    else key_tensor(key, t, 0);
    inputs.push_back(t.storage().data());
    cpu[i] = cpu_alias(t);
  }
  return true;
}

// True when a defined result lies over an argument's memory (Python's path makes it a view)
bool over_an_input(const at::Tensor* out, size_t count, const c10::SmallVectorImpl<const void*>& inputs) {
  for (size_t i = 0; i < count; ++i) {
    if (!out[i].defined()) continue;
    const void* data = out[i].storage().data();
    for (const void* in : inputs) {
      if (data != nullptr && in == data) return true;
    }
  }
  return false;
}

// True when an out= argument shares its storage with a tensor the op reads, over a byte range they
// both cover, without being that tensor's very layout (Python's path then checks element by element
// and refuses a partial overlap with CPU's words: CPU's values there depend on the order its kernel
// writes in, and on its threads - triu runs its rows in parallel). The same layout is CPU's in-place
// case, served here.
bool out_over_input(const std::vector<c10::Argument>& args, const torch::jit::Stack& stack, size_t base,
                    size_t n) {
  auto extent = [](const at::Tensor& t, int64_t* lo, int64_t* hi) {
    int64_t a = t.storage_offset(), b = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) (t.stride(d) < 0 ? a : b) += (t.size(d) - 1) * t.stride(d);
    *lo = a * static_cast<int64_t>(t.element_size());
    *hi = (b + 1) * static_cast<int64_t>(t.element_size());
  };
  auto same_layout = [](const at::Tensor& a, const at::Tensor& b) {
    if (a.scalar_type() != b.scalar_type() || a.storage_offset() != b.storage_offset() || a.sizes() != b.sizes()) {
      return false;
    }
    for (int64_t d = 0; d < a.dim(); ++d) {
      if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
    }
    return true;
  };
  for (size_t i = 0; i < n; ++i) {
    const c10::AliasInfo* ai = args[i].alias_info();
    const c10::IValue& v = stack[base + i];
    if (ai == nullptr || !ai->isWrite() || !args[i].kwarg_only() || !v.isTensor()) continue;
    const at::Tensor& out = v.toTensor();
    if (!out.defined() || out.numel() == 0 || out.storage().data() == nullptr) continue;
    int64_t o0, o1;
    extent(out, &o0, &o1);
    for (size_t j = 0; j < n; ++j) {
      const c10::AliasInfo* aj = args[j].alias_info();
      if (j == i || (aj != nullptr && aj->isWrite())) continue;
      const c10::IValue& w = stack[base + j];
      c10::SmallVector<at::Tensor, 4> read;
      if (w.isTensor()) {
        read.push_back(w.toTensor());
      } else if (w.isTensorList()) {
        for (const at::Tensor& t : w.toTensorList()) read.push_back(t);
      } else if (w.isList()) {
        for (const c10::IValue& x : w.toListRef()) {
          if (x.isTensor()) read.push_back(x.toTensor());
        }
      }
      for (const at::Tensor& t : read) {
        if (!t.defined() || t.numel() == 0 || t.storage().data() != out.storage().data() || same_layout(out, t)) {
          continue;
        }
        int64_t t0, t1;
        extent(t, &t0, &t1);
        if (o0 < t1 && t0 < o1) return true;
      }
    }
  }
  return false;
}

// The op's n arguments on the stack replaced by its `count` (<= 5) results, each defined one counted
// against HBM on core `index` and made a neuron tensor; every one counted, or none (false: one did
// not fit, and Python's path raises the OOM).
bool push_results(torch::jit::Stack* stack, size_t n, const at::Tensor* out, size_t count, int index) {
  FastBlock* blocks[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
  if (count > 5) return false;
  for (size_t i = 0; i < count; ++i) {
    if (!out[i].defined()) continue;
    blocks[i] = count_block(out[i], index);
    if (blocks[i] == nullptr) {
      for (size_t j = 0; j < i; ++j) uncount_block(blocks[j], index);
      return false;
    }
  }
  torch::jit::drop(*stack, n);
  for (size_t i = 0; i < count; ++i) {
    if (blocks[i] == nullptr) stack->emplace_back(out[i]);
    else stack->emplace_back(to_device(out[i], blocks[i], index));
  }
  return true;
}

void fast_cell(const c10::OperatorHandle& op, torch::jit::Stack* stack, OpKind kind) {
  const size_t n = op.schema().arguments().size();
  const size_t base = stack->size() - n;
  const bool backward = kind == kLstmCellBackward || kind == kGruCellBackward;
  const size_t tensors = kind == kGruCellBackward ? 2 : 5;  // then has_bias, for a backward
  if (n != tensors + (backward ? 1 : 0)) return slow(op, stack);
  thread_local std::string t_key;
  std::string& key = t_key;
  key.clear();
  key_int(key, reinterpret_cast<int64_t>(&op.schema()));
  int index = -1;
  std::vector<at::Tensor> cpu(tensors);
  c10::SmallVector<const void*, 8> inputs;
  if (!tensor_args(*stack, base, tensors, key, false, &index, cpu.data(), inputs)) return slow(op, stack);
  bool has_bias = false;
  if (backward) {
    const c10::IValue& v = (*stack)[base + tensors];
    if (!v.isBool()) return slow(op, stack);
    has_bias = v.toBool();
    key_int(key, 4 + has_bias);
  }
  if (index < 0) return slow(op, stack);
  bool complete = kind == kLstmCellBackward ? cpu[2].defined() && cpu[3].defined() && cpu[4].defined()
                  : kind == kGruCellBackward ? cpu[0].defined() && cpu[1].defined()
                  : cpu[0].defined() && cpu[1].defined() && cpu[2].defined() && cpu[3].defined() == cpu[4].defined();
  if (!complete) {
    return slow(op, stack);  // Python's path and its errors
  }
  std::vector<at::Tensor> out;
  try {
    HostScope host;
    out = kind == kLstmCell ? lstm_cell_values(cpu)
          : kind == kLstmCellBackward ? lstm_cell_backward_values(cpu, has_bias)
          : kind == kGruCell ? gru_cell_values(cpu) : gru_cell_backward_values(cpu, has_bias);
  } catch (...) {
    return slow(op, stack);  // (shapes that do not fit: Python raises it, in its words)
  }
  if (over_an_input(out.data(), out.size(), inputs)) return slow(op, stack);
  for (const auto& t : out) {
    if (!t.defined()) {
      key_int(key, 52);
      continue;
    }
    key_int(key, 51);
    key_tensor(key, t, 0);
  }
  int64_t handle = cost_handle(key);
  if (handle < 0) return learn(op, stack, key);  // the values are computed again there
  if (!push_results(stack, n, out.data(), out.size(), index)) return slow(op, stack);
  g_fast_hits++;
  log_entry(0, index, handle);
}

// ---- convolution forward on the datapath ---------------------------------------------------------
// torch_bridge.values.convolution for its common case, the same way: float32 2-d convolutions, not
// transposed, on one device, whose products cannot overflow (tensore.bounded), as tensore.conv_f32
// computes them: one datapath matmul per image of weights [K, C*R*S] and im2col patches (the input
// itself for a 1x1 stride-1 convolution; one matmul over every image's columns when an image has
// fewer than 8), or trn_conv2d_grouped for a few output channels per group (depthwise). The same
// CPU ops on the same operands with the datapath called with the same arguments, so the same bits.
// The output takes CPU's convolution's strides, read off CPU's own result once per signature (as
// values._check_convolution does; it raises CPU's errors there, so a call CPU refuses is Python's).
using GroupedFn = int (*)(const float*, int64_t, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float*);
std::atomic<GroupedFn> g_grouped{nullptr};  // trnsim.native.grouped_entry()
std::unordered_map<std::string, std::vector<int64_t>> g_conv_strides;  // signature -> CPU's output strides

// The bound tensore.bounded compares against (tensore.BOUND): a quarter of float32's largest value.
constexpr double kBound = static_cast<double>(std::numeric_limits<float>::max()) / 4;

extern "C" double trnsim_fast_max_abs(const void* p, int64_t n, int code);

// tensore.magnitude: the largest |x| (NaN when t holds one); trnsim_fast_max_abs's scan for a
// contiguous float32, bfloat16 or float16 host tensor, else aminmax (the same value either way)
double magnitude(const at::Tensor& t) {
  const int64_t n = t.numel();
  if (n == 0) return 0.0;
  const c10::ScalarType st = t.scalar_type();
  const int code = st == c10::kFloat ? 0 : st == c10::kBFloat16 ? 1 : st == c10::kHalf ? 2 : -1;
  if (code >= 0 && t.device().is_cpu() && t.is_contiguous() && !t._is_zerotensor()) {
    return trnsim_fast_max_abs(t.const_data_ptr(), n, code);
  }
  auto mm = at::aminmax(t);
  double lo = std::get<0>(mm).item<double>(), hi = std::get<1>(mm).item<double>();
  if (std::isnan(lo) || std::isnan(hi)) return std::nan("");
  return std::max(-lo, hi);
}

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

void fast_conv(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Datapath dp;
  GroupedFn grouped = g_grouped.load();
  if (grouped == nullptr || !datapath_ready(&dp)) return slow(op, stack);
  const BatchedFn fn = dp.fn;
  const int64_t k_chunk = dp.k_chunk;
  const int threads = dp.threads;
  const size_t n = op.schema().arguments().size();  // input, weight, bias, stride, padding, dilation,
  if (n != 9) return slow(op, stack);                // transposed, output_padding, groups
  const size_t base = stack->size() - n;
  const torch::jit::Stack& a = *stack;
  if (!a[base].isTensor() || !a[base + 1].isTensor() || !(a[base + 2].isTensor() || a[base + 2].isNone()) ||
      !a[base + 3].isIntList() || !a[base + 4].isIntList() || !a[base + 5].isIntList() || !a[base + 6].isBool() ||
      !a[base + 7].isIntList() || !a[base + 8].isInt()) {
    return slow(op, stack);
  }
  const at::Tensor& x = a[base].toTensor();
  const at::Tensor& w = a[base + 1].toTensor();
  at::Tensor b = a[base + 2].isTensor() ? a[base + 2].toTensor() : at::Tensor();
  auto stride = a[base + 3].toIntVector(), padding = a[base + 4].toIntVector(), dilation = a[base + 5].toIntVector();
  auto output_padding = a[base + 7].toIntVector();
  const bool transposed = a[base + 6].toBool();
  const int64_t groups = a[base + 8].toInt();
  int index = -1;
  // (float32 only: the conv path's datapath calls and CPU kernels are float32's)
  if (transposed || x.scalar_type() != c10::kFloat || w.scalar_type() != c10::kFloat ||
      (b.defined() && b.scalar_type() != c10::kFloat) || !matmul_operand(x, 4, &index) ||
      !matmul_operand(w, 4, &index) || (b.defined() && !matmul_operand(b, b.dim(), &index)) || x.numel() == 0 ||
      w.numel() == 0 || stride.size() != 2 || padding.size() != 2 || dilation.size() != 2 || groups < 1) {
    return slow(op, stack);
  }
  thread_local std::string t_key;
  std::string& key = t_key;
  key.clear();
  key_int(key, reinterpret_cast<int64_t>(&op.schema()));
  key_strides(key, x);
  key_strides(key, w);
  if (b.defined()) key_strides(key, b);
  else key_int(key, 6);
  for (const auto* l : {&stride, &padding, &dilation, &output_padding}) key_int_list(key, *l);
  key_int(key, groups);
  int64_t handle = cost_handle(key);
  if (handle < 0) return learn(op, stack, key);
  const at::Tensor xa = cpu_alias(x), wa = cpu_alias(w), ba = b.defined() ? cpu_alias(b) : at::Tensor();
  std::vector<int64_t> strides;
  {
    thread_local std::unordered_map<std::string, std::vector<int64_t>> mine;
    auto hit = mine.find(key);
    if (hit == mine.end()) {
      std::lock_guard<std::mutex> lock(g_fast_mutex);
      auto it = g_conv_strides.find(key);
      if (it != g_conv_strides.end()) hit = mine.emplace(key, it->second).first;
    }
    if (hit != mine.end()) {
      strides = hit->second;
    } else {
      try {  // CPU's convolution on the same views (values dropped): its checks and its layout
        at::Tensor probe = at::convolution(xa, wa, ba, stride, padding, dilation, false, output_padding, groups);
        strides = probe.strides().vec();
      } catch (...) {
        return slow(op, stack);  // CPU refuses it: Python raises CPU's error
      }
      std::lock_guard<std::mutex> lock(g_fast_mutex);
      g_conv_strides.emplace(key, strides);
    }
  }
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t K = w.size(0), CG = w.size(1), R = w.size(2), S = w.size(3);
  const int64_t s0 = stride[0], s1 = stride[1], p0 = padding[0], p1 = padding[1], d0 = dilation[0], d1 = dilation[1];
  if (s0 < 1 || s1 < 1) return slow(op, stack);
  const int64_t ho = floor_div(H + 2 * p0 - d0 * (R - 1) - 1, s0) + 1, wo = floor_div(W + 2 * p1 - d1 * (S - 1) - 1, s1) + 1;
  if (ho <= 0 || wo <= 0 || static_cast<int64_t>(strides.size()) != 4) return slow(op, stack);
  at::Tensor out;  // float32 [N, K, Ho, Wo]
  auto t0 = std::chrono::steady_clock::now();
  try {
    // tensore.bounded(w.numel() // K, x, w, 1.0, magnitude(bias)): the products cannot overflow
    const double extra = ba.defined() ? magnitude(ba) : 0.0;
    const double bound = static_cast<double>(w.numel() / K) * magnitude(xa) * magnitude(wa) * 1.0 + extra;
    if (!(bound < kBound)) return slow(op, stack);
    int rc = 0;
    if (groups == 1) {  // tensore._conv_batched
      at::Tensor moving;
      if (R == 1 && S == 1 && s0 == 1 && s1 == 1 && p0 == 0 && p1 == 0) {
        moving = xa.reshape({N, C, -1});
      } else {  // tensore.im2col
        at::Tensor xp = (p0 != 0 || p1 != 0) ? at::pad(xa, {p1, p1, p0, p0}) : xa;
        auto st = xp.strides();
        moving = xp.as_strided({N, C, R, S, ho, wo}, {st[0], st[1], d0 * st[2], d1 * st[3], s0 * st[2], s1 * st[3]},
                               xp.storage_offset())
                     .reshape({N, C * R * S, ho * wo});
      }
      const int64_t ck = moving.size(1), pixels = moving.size(2);
      at::Tensor w2 = wa.reshape({K, ck});  // stationary: its transpose [ck, K]
      if (pixels < 8) {  // one matmul over N*L columns
        at::Tensor mv = moving.permute({1, 0, 2}).reshape({ck, N * pixels});
        const int64_t cols = N * pixels;
        at::Tensor res = psum_result({K, cols});
        rc = fn(w2.const_data_ptr(), g_f32_code.load(), 0, w2.stride(1), w2.stride(0), mv.const_data_ptr(),
                g_f32_code.load(), 0, mv.stride(0), mv.stride(1), res.mutable_data_ptr<float>(), 0, cols, 1, 1, ck, K,
                cols, k_chunk, 0, -1, g_fma_on.load(), threads);
        if (rc == 0) {
          HostScope host;
          out = res.view({K, N, pixels}).permute({1, 0, 2}).contiguous();
        }
      } else {
        out = psum_result({N, K, pixels});
        rc = fn(w2.const_data_ptr(), g_f32_code.load(), 0, w2.stride(1), w2.stride(0), moving.const_data_ptr(),
                g_f32_code.load(), moving.stride(0), moving.stride(1), moving.stride(2), out.mutable_data_ptr<float>(),
                K * pixels, pixels, 1, N, ck, K, pixels, k_chunk, 0, -1, g_fma_on.load(), threads);
      }
    } else if (K / groups <= 8) {  // depthwise and the like: trn_conv2d_grouped on the padded input
      at::Tensor xp = at::pad(xa, {p1, p1, p0, p0}).contiguous();
      at::Tensor wc = wa.contiguous();
      out = psum_result({N, K, ho, wo});
      rc = grouped(xp.const_data_ptr<float>(), N, C, xp.size(2), xp.size(3), wc.const_data_ptr<float>(), K, CG, R, S,
                   groups, s0, s1, d0, d1, ho, wo, k_chunk, out.mutable_data_ptr<float>());
    } else {
      return slow(op, stack);  // one bmm over the groups: Python's
    }
    if (rc != 0) return slow(op, stack);  // Python raises the datapath's error
    out = out.view({N, K, ho, wo});
    if (ba.defined()) out.add_(ba.view({1, -1, 1, 1}));
    if (out.strides().vec() != strides) {  // CPU's layout (channels-last, or its own for size-1 dimensions)
      HostScope host;
      out = at::empty_strided(out.sizes(), strides, at::TensorOptions().dtype(at::kFloat)).copy_(out);
    }
  } catch (...) {
    return slow(op, stack);  // (the host is out of memory, or a view refused: Python's path and its error)
  }
  g_datapath_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  FastBlock* block = count_block(out, index);
  if (block == nullptr) return slow(op, stack);  // Python raises the OOM
  torch::jit::drop(*stack, n);
  stack->emplace_back(to_device(out, block, index));
  g_fast_hits++;
  log_entry(0, index, handle);
}

// ---- convolution backward: CPU's kernel ------------------------------------------------------------
// torch_bridge.values.convolution_backward: CPU's convolution_backward on the arguments' aliases
// (16-bit inputs with values._cpu_dilation's undilated size-1 filter dimensions), its results
// counted against HBM, and the launches Python charged for the signature (the input and weight
// gradients' kernels, then the bias gradient's), which it teaches as a list.
void fast_conv_backward(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();  // grad_output, input, weight, stride, padding, dilation,
  if (n != 10) return slow(op, stack);               // transposed, output_padding, groups, output_mask
  const size_t base = stack->size() - n;
  const torch::jit::Stack& a = *stack;
  if (!a[base].isTensor() || !a[base + 1].isTensor() || !a[base + 2].isTensor() || !a[base + 3].isIntList() ||
      !a[base + 4].isIntList() || !a[base + 5].isIntList() || !a[base + 6].isBool() || !a[base + 7].isIntList() ||
      !a[base + 8].isInt() || !a[base + 9].isBoolList()) {
    return slow(op, stack);
  }
  thread_local std::string t_key;
  std::string& key = t_key;
  key.clear();
  key_int(key, reinterpret_cast<int64_t>(&op.schema()));
  int index = -1;
  at::Tensor cpu[3];
  c10::SmallVector<const void*, 3> inputs;
  if (!tensor_args(*stack, base, 3, key, true, &index, cpu, inputs) || !cpu[0].defined() || !cpu[1].defined() ||
      !cpu[2].defined()) {
    return slow(op, stack);
  }
  auto stride = a[base + 3].toIntVector(), padding = a[base + 4].toIntVector(), dilation = a[base + 5].toIntVector();
  auto output_padding = a[base + 7].toIntVector();
  const bool transposed = a[base + 6].toBool();
  const int64_t groups = a[base + 8].toInt();
  auto mask_list = a[base + 9].toBoolList();
  if (mask_list.size() != 3) return slow(op, stack);
  std::array<bool, 3> mask{mask_list.get(0), mask_list.get(1), mask_list.get(2)};
  for (const auto* l : {&stride, &padding, &dilation, &output_padding}) key_int_list(key, *l);
  key_int(key, 4 + transposed);
  key_int(key, groups);
  for (bool m : mask) key_int(key, 4 + m);
  const std::vector<int64_t>* handles = cost_handles(key);
  if (handles == nullptr) return learn(op, stack, key);
  const at::Tensor &g = cpu[0], &x = cpu[1], &w = cpu[2];
  // values._cpu_dilation: CPU's 16-bit oneDNN kernel is given dilation 1 in size-1 filter dimensions
  if ((x.scalar_type() == c10::kHalf || x.scalar_type() == c10::kBFloat16) &&
      static_cast<int64_t>(dilation.size()) == w.dim() - 2) {
    for (size_t i = 0; i < dilation.size(); ++i) {
      if (w.size(static_cast<int64_t>(i) + 2) == 1 && dilation[i] > 1) dilation[i] = 1;
    }
  }
  if (w.dim() < 2) return slow(op, stack);
  const int64_t bias_size = transposed ? w.size(1) * groups : w.size(0);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> res;
  try {
    HostScope host;
    res = at::convolution_backward(g, x, w, std::vector<int64_t>{bias_size}, stride, padding, dilation, transposed,
                                   output_padding, groups, mask);
  } catch (...) {
    return slow(op, stack);  // Python raises CPU's error
  }
  at::Tensor out[3] = {std::get<0>(res), std::get<1>(res), std::get<2>(res)};
  if (over_an_input(out, 3, inputs) || !push_results(stack, n, out, 3, index)) return slow(op, stack);
  g_fast_hits++;
  for (int64_t h : *handles) log_entry(0, index, h);
}

// ---- batch norm ---------------------------------------------------------------------------------------
// A native batch norm's call the fast path may run CPU's kernel on as it is (anything else goes to
// Python's screen, values._batch_norm_family, which gives it a dense copy or refuses it):
// an input of 2 dims or more that is not empty, its weight, bias and statistics 1-D, contiguous
// and of input.size(1) elements or more (CPU's kernels read that many, as if contiguous), and the
// statistics the call dereferences given (an evaluation's running ones, a training backward's saved
// ones). A functional op's kernel runs before its signature's cost is looked up, so without this a
// refused call (one that crashes CPU) would reach CPU's kernel.
bool batch_norm_plain(size_t params_from, const c10::OperatorHandle& op, const torch::jit::Stack& s, size_t base) {
  const size_t n = op.schema().arguments().size();
  const bool backward = params_from == 2;
  const c10::IValue& xv = s[base + params_from - 1];
  if (!xv.isTensor()) return false;
  const at::Tensor& x = xv.toTensor();
  if (!x.defined() || x.dim() < 2 || x.numel() == 0) return false;
  const int64_t c = x.size(1);
  const size_t to = backward ? 7 : 5;  // (weight, running_mean, running_var, save_mean, save_*; weight, bias, running_*)
  size_t flag = backward ? 7 : 5;  // train / update / training
  if (!backward && n > 3 && s[base + 3].isBool()) flag = 3;  // _native_batch_norm_legit.no_stats: no statistics
  const size_t last = std::min(flag, to);
  for (size_t i = params_from; i < last && i < n; ++i) {
    const c10::IValue& v = s[base + i];
    if (v.isNone()) continue;
    if (!v.isTensor()) return false;
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) continue;
    if (t.dim() != 1 || !t.is_contiguous() || t.numel() < c) return false;
  }
  // (_native_batch_norm_legit_no_training has no flag there: an evaluation)
  const bool training = flag < n && s[base + flag].isBool() && s[base + flag].toBool();
  if (!backward && training) return true;  // (a training forward dereferences no statistic)
  const size_t first = backward && training ? 5 : 3;  // the saved statistics, or the running ones
  for (size_t i = first; i < first + 2; ++i) {
    if (i >= last || !s[base + i].isTensor() || !s[base + i].toTensor().defined()) return false;
  }
  return true;
}

// native_batch_norm writes its running_mean and running_var in training without saying so in its
// schema, so it is not served as a functional op (whose first call runs the CPU kernel here and
// again in Python's path to learn the cost: the statistics would move twice). Here the cost is
// looked up first, from the arguments alone; a signature not learnt yet runs only Python's path.
// Then CPU's kernel on the arguments' aliases (the running statistics updated in place, in
// device memory, as Python's path updates them) and its fresh results counted against HBM.
void fast_batch_norm(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();  // input, weight, bias, running_mean, running_var,
  if (n != 8) return slow(op, stack);                // training, momentum, eps
  const size_t base = stack->size() - n;
  const torch::jit::Stack& a = *stack;
  if (!a[base].isTensor() || !a[base + 5].isBool() || !a[base + 6].isDouble() || !a[base + 7].isDouble()) {
    return slow(op, stack);
  }
  thread_local std::string t_key;
  std::string& key = t_key;
  key.clear();
  key_int(key, reinterpret_cast<int64_t>(&op.schema()));
  int index = -1;
  at::Tensor cpu[5];
  c10::SmallVector<const void*, 5> inputs;
  if (!tensor_args(*stack, base, 5, key, true, &index, cpu, inputs)) return slow(op, stack);
  // (a strided weight or statistic: Python's screen gives it a dense copy, then teaches the cost of this
  // signature, which must not let the kernel read it here as it is)
  if (!batch_norm_plain(1, op, *stack, base)) return slow(op, stack);
  const bool training = a[base + 5].toBool();
  key_int(key, 4 + training);
  key_int(key, 3);  // momentum and eps: float values never change the kernel (Python's key ignores them too)
  key_int(key, 3);
  if (index < 0) return slow(op, stack);
  int64_t handle = cost_handle(key);
  if (handle < 0) return learn(op, stack, key);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> res;
  try {
    HostScope host;
    res = at::native_batch_norm(cpu[0], cpu[1], cpu[2], cpu[3], cpu[4], training, a[base + 6].toDouble(),
                                a[base + 7].toDouble());
  } catch (...) {
    return slow(op, stack);  // Python raises CPU's error (CPU checks before it writes the statistics)
  }
  at::Tensor out[3] = {std::get<0>(res), std::get<1>(res), std::get<2>(res)};
  if (!out[0].defined() || !out[1].defined() || !out[2].defined() || over_an_input(out, 3, inputs) ||
      !push_results(stack, n, out, 3, index)) {
    return slow(op, stack);
  }
  g_fast_hits++;
  log_entry(0, index, handle);
}

// A defined result of the CPU kernel the fast path can hand back as a fresh neuron tensor, keyed into
// the signature (its shape, dtype and layout); false for Python's path: not a plain strided host
// tensor (a nested result has no sizes: Python refuses it in its words), or over an argument's
// memory (Python makes it a view of that argument).
bool key_result(const at::Tensor& t, const c10::SmallVector<const void*, 8>& inputs, std::string& key) {
  if (!t.device().is_cpu() || t.layout() != c10::kStrided || t.is_nested() || t.is_conj() || t.is_neg() ||
      t._is_zerotensor() || t.requires_grad()) {
    return false;
  }
  const void* data = t.storage().data();
  for (const void* in : inputs) {
    if (data != nullptr && in == data) return false;
  }
  key_int(key, 51);
  key_tensor(key, t, 0);
  return true;
}

// A functional _foreach_* op's results (a fresh Tensor[]): each keyed into the signature as a
// single op's results are, counted against HBM (all or none: Python then raises the OOM), and
// handed back as neuron tensors over their host memory; anything odd (a result over an argument's
// memory, a zero tensor, ...) is Python's, which relabels each result.
void push_list(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t n, const c10::IValue& list,
               const c10::SmallVector<const void*, 8>& inputs, std::string& key, int index) {
  std::vector<at::Tensor> res = list.toTensorVector();
  for (const at::Tensor& t : res) {
    if (!t.defined() || !key_result(t, inputs, key)) return slow(op, stack);
  }
  key_int(key, 54);
  int64_t handle = cost_handle(key);
  if (handle < 0) return learn(op, stack, key);
  std::vector<FastBlock*> blocks(res.size(), nullptr);
  std::vector<const at::Tensor*> results;
  results.reserve(res.size());
  for (const at::Tensor& t : res) results.push_back(&t);
  if (!count_all(results.data(), res.size(), index, blocks.data())) return slow(op, stack);
  c10::List<at::Tensor> out;
  out.reserve(res.size());
  for (size_t i = 0; i < res.size(); ++i) out.push_back(to_device(res[i], blocks[i], index));
  torch::jit::drop(*stack, n);
  stack->emplace_back(std::move(out));
  g_fast_hits++;
  log_entry(0, index, handle);
}

// item() (aten::_local_scalar_dense) of a one-element neuron tensor: the value read from its memory,
// the launch Python charges for the signature logged, then the host's wait for the core logged in
// its place (kind -1) rather than done now: the device takes it in order, as Device.synchronize(index)
// after the launch, whenever it next issues or reads time, so the same ticks without a drain of the
// log per item(). Inside a graph capture (synchronize settles the capture) and for a conj or neg view
// (its alias would drop the bit) Python's path runs it.
void fast_item(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (t_capture != 0 || op.schema().arguments().size() != 1 || !stack->back().isTensor()) return slow(op, stack);
  const at::Tensor& t = stack->back().toTensor();
  if (!t.defined() || t.device().type() != kNeuron || t.layout() != c10::kStrided || t.numel() != 1 ||
      t.is_conj() || t.is_neg() || t._is_zerotensor()) {
    return slow(op, stack);
  }
  const int index = t.device().index() < 0 ? 0 : t.device().index();
  thread_local std::string t_key;
  std::string& key = t_key;
  key.clear();
  key_int(key, reinterpret_cast<int64_t>(&op.schema()));
  key_tensor(key, t, 0);
  int64_t handle = cost_handle(key);
  if (handle < 0) return learn(op, stack, key);
  // the element must lie in memory the storage holds (a freed one: Python's error, as cpu_alias's check)
  if (t.storage().data() == nullptr ||
      (t.storage_offset() + 1) * static_cast<int64_t>(t.itemsize()) > static_cast<int64_t>(t.storage().nbytes())) {
    return slow(op, stack);
  }
  c10::Scalar value;
  try {
    // CPU's own kernel for _local_scalar_dense, reading the element where the device keeps it (host
    // memory): the same value the CPU dispatch of an alias gives, without making the alias
    value = at::native::_local_scalar_dense_cpu(t);
  } catch (...) {
    return slow(op, stack);
  }
  stack->pop_back();
  stack->emplace_back(value);
  g_fast_hits++;
  log_launch_and_wait(index, handle);
}

void fast_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!g_fast_master.load(std::memory_order_relaxed) || at::hasCallbacks() ||
      g_log_count.load(std::memory_order_relaxed) >= kLogMax || tracing()) {
    return slow(op, stack);
  }
  const OpFast& f = op_fast(op);
  if (f.kind == kView) {  // metadata only: a host-side op, the CPU kernel on the neuron tensors
    log_entry(1, t_capture, f.name_id);  // (inside Device.recorded, its capture counts it: the token)
    return op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }
  if ((f.kind == kEmpty || f.kind == kEmptyStrided) && !g_history.load()) {
    return fast_empty(op, stack, f.kind);  // launches nothing: served whatever the launch gate says (compiled graphs)
  }
  if (f.kind == kOther || !g_fast_launch.load(std::memory_order_relaxed) || g_history.load()) return slow(op, stack);
  if (f.kind == kToCopy) return fast_to_copy(op, stack);  // (one tensor each: no alias to share)
  if (f.kind == kLocalScalar) return fast_item(op, stack);
  if (f.params_from != 0 && !batch_norm_plain(f.params_from, op, *stack, stack->size() - op.schema().arguments().size())) {
    return slow(op, stack);
  }
  AliasScope scope;  // this call's CPU aliases share a storage where their tensors share memory
  if (f.kind == kCopyFrom) return fast_copy(op, stack);
  if (f.kind >= kLstmCell && f.kind <= kGruCellBackward) return fast_cell(op, stack, f.kind);
  if (f.kind == kConv) return fast_conv(op, stack);
  if (f.kind == kConvBackward) return fast_conv_backward(op, stack);
  if (f.kind == kBatchNorm) return fast_batch_norm(op, stack);
  if (f.kind >= kMm) return fast_matmul(op, stack, f.kind);
  const auto& schema_args = op.schema().arguments();
  const size_t n = schema_args.size();
  const size_t base = stack->size() - n;
  thread_local std::string t_key;  // (a nested call can only come from slow(), after which this call returns)
  std::string& key = t_key;
  key.clear();
  key_int(key, reinterpret_cast<int64_t>(&op.schema()));
  int index = -1;
  std::vector<c10::IValue> cargs;
  cargs.reserve(n);
  // neuron argument -> its CPU alias (one per tensor, as Python's view cache gives one per window)
  c10::SmallVector<std::pair<c10::TensorImpl*, c10::IValue>, 6> aliases;
  auto alias_of = [&aliases](const at::Tensor& t) -> const c10::IValue& {
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    for (const auto& a : aliases) {
      if (a.first == impl) return a.second;
    }
    aliases.emplace_back(impl, c10::IValue(cpu_alias(t)));
    return aliases.back().second;
  };
  c10::SmallVector<std::pair<size_t, c10::TensorImpl*>, 4> writes;  // written argument -> its CPU alias
  // out= arguments without memory (a composite op's `at::empty({0})`, e.g. arange, logical_not,
  // index.Tensor): the kernel writes a fresh host tensor each, which the out then adopts (Python's
  // `dev_out.set_(relabel(result))`); only when every written argument is one of these
  c10::SmallVector<std::pair<size_t, at::Tensor>, 2> fresh;
  size_t written_args = 0;
  c10::SmallVector<const void*, 8> inputs;  // the neuron arguments' memory
  // a tensor of a list argument: on the device, keyed, its memory noted, its CPU alias in `alias`
  // (false: Python's path takes the call)
  auto list_tensor = [&](const at::Tensor& t, at::Tensor* alias) -> bool {
    if (!t.defined() || t.device().type() != kNeuron || t.layout() != c10::kStrided || t.is_conj() || t.is_neg()) {
      return false;
    }
    int ti = t.device().index() < 0 ? 0 : t.device().index();
    if (index < 0) index = ti;
    else if (ti != index) return false;
    key_tensor(key, t, 0);
    inputs.push_back(t.storage().data());
    *alias = alias_of(t).toTensor();
    return true;
  };
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = (*stack)[base + i];
    const c10::AliasInfo* ai = schema_args[i].alias_info();
    bool written = ai != nullptr && ai->isWrite();
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        if (written) return slow(op, stack);
        key_int(key, 1);
        cargs.push_back(v);
        continue;
      }
      if (t.layout() != c10::kStrided || t.is_conj() || t.is_neg()) return slow(op, stack);
      if (t.device().type() == kNeuron) {
        int ti = t.device().index() < 0 ? 0 : t.device().index();
        if (index < 0) index = ti;
        else if (ti != index) return slow(op, stack);  // two devices: Python's error
        if (written) ++written_args;
        if (written && schema_args[i].kwarg_only() && t.numel() == 0) {
          const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
          if (f.kind != kWrites || t.storage().nbytes() != 0 || !impl->allow_tensor_metadata_change()) {
            return slow(op, stack);  // Python computes into a fresh out and writes it where CPU would
          }
          key_tensor(key, t, 0);
          if (fresh.size() == 2) return slow(op, stack);
          at::Tensor cpu;
          {
            HostScope host;  // (its memory, when the kernel resizes it, backs a neuron tensor)
            cpu = at::empty({0}, at::TensorOptions().dtype(t.scalar_type()));
          }
          writes.emplace_back(i, cpu.unsafeGetTensorImpl());
          fresh.emplace_back(i, cpu);
          cargs.emplace_back(cpu);
          continue;
        }
        key_tensor(key, t, 0);
        inputs.push_back(t.storage().data());
        size_t known = aliases.size();
        const c10::IValue& found = alias_of(t);
        // an out= that is also an input (index_copy_ is index_copy.out(self, .., out=self)) costs other than a
        // fresh out: an in-place scatter writes only its rows (Python's key tells the two apart too)
        if (written && aliases.size() == known) key_int(key, 13);
        cargs.push_back(found);
        if (written) writes.emplace_back(i, found.toTensor().unsafeGetTensorImpl());
      } else if (t.device().is_cpu() && t.dim() == 0 && !written) {  // a host scalar
        key_tensor(key, t, 1);
        if (t.unsafeGetTensorImpl()->is_wrapped_number() &&
            (t.scalar_type() == c10::kLong || t.scalar_type() == c10::kBool)) {
          // Python sees the number itself
          key_int(key, t.scalar_type() == c10::kBool ? static_cast<int64_t>(*t.const_data_ptr<bool>())
                                                     : *t.const_data_ptr<int64_t>());
        }
        cargs.push_back(v);
      } else {
        return slow(op, stack);
      }
      continue;
    }
    if (v.isInt()) {
      key_int(key, 2);
      key_int(key, v.toInt());
    } else if (v.isDouble()) {
      key_int(key, 3);  // float values never change the kernel (Python's key ignores them too)
    } else if (v.isBool()) {
      key_int(key, 4 + v.toBool());
    } else if (v.isNone()) {
      key_int(key, 6);
    } else if (v.isIntList()) {
      key_int_list(key, v.toIntVector());
    } else if (v.isString()) {
      key_int(key, 8);
      key.append(v.toStringRef());
      key_int(key, 0);
    } else if (v.isComplexDouble()) {
      key_int(key, 9);
    } else if (v.isBoolList()) {
      key_int(key, 11);
      auto l = v.toBoolList();
      key_int(key, static_cast<int64_t>(l.size()));
      for (bool x : l) key_int(key, x);
    } else if (v.isDoubleList()) {
      key_int(key, 12);
      key_int(key, static_cast<int64_t>(v.toDoubleList().size()));
    } else if (v.isList() && !written && is_optional_tensor_list(schema_args[i].type())) {
      // index.Tensor's indices: each None or a tensor on the device, read through its CPU alias
      auto l = v.toListRef();
      key_int(key, 14);
      key_int(key, static_cast<int64_t>(l.size()));
      c10::List<std::optional<at::Tensor>> cpu;
      cpu.reserve(l.size());
      for (const c10::IValue& x : l) {
        if (x.isNone()) {
          key_int(key, 6);
          cpu.push_back(std::nullopt);
          continue;
        }
        at::Tensor alias;
        if (!x.isTensor() || !list_tensor(x.toTensor(), &alias)) return slow(op, stack);
        cpu.push_back(std::move(alias));
      }
      cargs.emplace_back(std::move(cpu));
      continue;
    } else if (v.isList() && !written && !v.isTensorList()) {  // a Scalar[] (a foreach op's per-tensor scalars)
      auto l = v.toListRef();
      key_int(key, 13);
      key_int(key, static_cast<int64_t>(l.size()));
      for (const c10::IValue& x : l) {  // as Python's key: ints and bools by value, floats by kind
        if (x.isInt()) {
          key_int(key, 2);
          key_int(key, x.toInt());
        } else if (x.isDouble()) {
          key_int(key, 3);
        } else if (x.isBool()) {
          key_int(key, 4 + x.toBool());
        } else {
          return slow(op, stack);
        }
      }
    } else if (v.isTensorList()) {  // every element a defined tensor on the device (a written list:
      auto list = v.toTensorList();  // an in-place foreach op's self, written through its CPU aliases)
      key_int(key, 10);
      key_int(key, static_cast<int64_t>(list.size()));
      c10::List<at::Tensor> cpu;
      cpu.reserve(list.size());
      for (const at::Tensor& t : list) {
        at::Tensor alias;
        if (!list_tensor(t, &alias)) return slow(op, stack);
        cpu.push_back(std::move(alias));
      }
      cargs.emplace_back(std::move(cpu));
      continue;
    } else {
      return slow(op, stack);  // lists of tensors, devices, generators, ...
    }
    cargs.push_back(v);
  }
  if (index < 0) return slow(op, stack);
  if (!fresh.empty() && fresh.size() != written_args) return slow(op, stack);
  if (f.kind == kWrites && out_over_input(schema_args, *stack, base, n)) return slow(op, stack);
  int64_t handle = -1;
  if (f.bump_list && !c10::InferenceMode::is_enabled()) {
    // CPU bumps each element after writing it, and an inference tensor's bump outside inference
    // mode raises: the elements before it written, the rest not. Python's path does that.
    for (const at::Tensor& t : (*stack)[base].toTensorList()) {
      if (t.is_inference()) return slow(op, stack);
    }
  }
  if (f.kind == kWrites && fresh.empty()) {  // the results are the written arguments: the signature is complete
    key_int(key, 50);
    handle = cost_handle(key);
    if (handle < 0) return learn(op, stack, key);
  }
  torch::jit::Stack cstack(std::move(cargs));
  try {
    HostScope host;
    // the CPU kernel itself: autograd, autocast and the modes were this call's, on the neuron tensors
    // (the aliases need none of them, and nothing records them)
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &cstack);
  } catch (...) {  // (kernels check their arguments before they write: running it again is safe)
    return slow(op, stack);  // Python raises it, in its words (or retries an out= it must resize)
  }
  if (!fresh.empty()) {  // the signature is complete with the results' shapes; then the outs adopt them
    key_int(key, 53);
    for (const auto& fr : fresh) {
      if (fr.second.numel() == 0) return slow(op, stack);  // an empty result: Python resizes the out
      key_tensor(key, fr.second, 0);
    }
    handle = cost_handle(key);
    if (handle < 0) return learn(op, stack, key);  // (the device outs are untouched so far)
    FastBlock* got[2] = {nullptr, nullptr};
    for (size_t j = 0; j < fresh.size(); ++j) {
      got[j] = count_block(fresh[j].second, index);
      if (got[j] == nullptr) {  // every result counted, or none: Python raises the OOM
        for (size_t k = 0; k < j; ++k) uncount_block(got[k], index);
        return slow(op, stack);
      }
    }
    for (size_t j = 0; j < fresh.size(); ++j) {
      const at::Tensor& cpu = fresh[j].second;
      at::Tensor dev = to_device(cpu, got[j], index);
      c10::TensorImpl* out = (*stack)[base + fresh[j].first].toTensor().unsafeGetTensorImpl();
      out->set_storage_keep_dtype(dev.storage());
      out->set_sizes_and_strides(cpu.sizes(), cpu.strides(), cpu.storage_offset());
    }
  }
  if (f.kind == kWrites) {
    std::vector<c10::IValue> results;
    for (const auto& r : cstack) {
      c10::TensorImpl* impl = r.isTensor() ? r.toTensor().unsafeGetTensorImpl() : nullptr;
      const c10::IValue* dev = nullptr;
      for (const auto& w : writes) {
        if (w.second == impl) dev = &(*stack)[base + w.first];
      }
      TORCH_INTERNAL_ASSERT(dev != nullptr, "neuron fast path: ", op.schema().name(),
                            "'s CPU kernel returned a tensor other than its written arguments");
      results.push_back(*dev);
    }
    if (f.bump_list) {  // once per element, duplicates too (CPU's loop writes and bumps each)
      for (const at::Tensor& t : (*stack)[base].toTensorList()) t.unsafeGetTensorImpl()->bump_version();
    }
    for (const auto& w : writes) {  // an out= kernel may restride its outputs in place: the neuron
      if (!schema_args[w.first].kwarg_only() || !fresh.empty()) continue;  // tensor takes the new layout (Python's set_)
      c10::TensorImpl* dev = (*stack)[base + w.first].toTensor().unsafeGetTensorImpl();
      c10::TensorImpl* cpu = w.second;
      if (cpu->sizes() != dev->sizes() || cpu->strides() != dev->strides() ||
          cpu->storage_offset() != dev->storage_offset()) {
        dev->set_sizes_and_strides(cpu->sizes(), cpu->strides(), cpu->storage_offset());
      }
    }
    torch::jit::drop(*stack, n);
    for (auto& r : results) stack->push_back(std::move(r));
    g_fast_hits++;
    log_entry(0, index, handle);
    return;
  }
  if (cstack.size() == 1 && cstack[0].isTensorList()) return push_list(op, stack, n, cstack[0], inputs, key, index);
  for (const auto& r : cstack) {
    if (!r.isTensor()) return slow(op, stack);
    const at::Tensor& t = r.toTensor();
    if (!t.defined()) {  // an output the mask left out (None to Python)
      key_int(key, 52);
      continue;
    }
    if (!key_result(t, inputs, key)) return slow(op, stack);
  }
  handle = cost_handle(key);
  if (handle < 0) return learn(op, stack, key);  // the value is computed again there
  FastBlock* blocks[8];
  const at::Tensor* results[8];
  if (cstack.size() > 8) return slow(op, stack);
  for (size_t i = 0; i < cstack.size(); ++i) results[i] = &cstack[i].toTensor();
  // (not under the ledger's lock: Python's allocation takes it)
  if (!count_all(results, cstack.size(), index, blocks)) return slow(op, stack);
  torch::jit::drop(*stack, n);
  for (size_t i = 0; i < cstack.size(); ++i) {
    if (blocks[i] == nullptr) stack->push_back(cstack[i]);
    else stack->emplace_back(to_device(cstack[i].toTensor(), blocks[i], index));
  }
  g_fast_hits++;
  log_entry(0, index, handle);
}

// ---- in-place binary ops -------------------------------------------------------------------------
// A backend without its own `add_` gets PyTorch's CompositeExplicitAutogradNonFunctional kernel: the
// op's structured meta (a TensorIterator over the neuron tensors: broadcasting, dtypes, overlap,
// the written tensor's strides) and then `add.out(self, other, alpha, out=self)`, which the fast
// path serves. When `other` has self's dtype and sizes, both are contiguous on one neuron device
// and `other` shares no memory with self (or is self), the meta can only agree - nothing to
// broadcast or promote, no overlap, strides as they are - so these go straight to the out= call:
// the same call, the same dispatch above it (autograd, the version counter), the same values and
// cost. Anything else takes PyTorch's kernel, with its checks and errors.
bool plain_inplace(const at::Tensor& self, const at::Tensor& other) {
  if (!self.defined() || !other.defined() || self.device().type() != kNeuron || other.device() != self.device() ||
      self.layout() != c10::kStrided || other.layout() != c10::kStrided || self.scalar_type() != other.scalar_type() ||
      self.sizes() != other.sizes() || !self.is_contiguous() || !other.is_contiguous() || self.is_conj() ||
      self.is_neg() || other.is_conj() || other.is_neg() || self._is_zerotensor() || other._is_zerotensor()) {
    return false;
  }
  return other.unsafeGetTensorImpl() == self.unsafeGetTensorImpl() || !other.storage().is_alias_of(self.storage());
}

// add's and sub's alpha_check passes (its errors are the meta's)
bool plain_alpha(const at::Tensor& self, const c10::Scalar& alpha) {
  auto dt = self.scalar_type();
  return (!alpha.isBoolean() || dt == c10::kBool) &&
         (c10::isFloatingType(dt) || c10::isComplexType(dt) || alpha.isIntegral(true));
}

// The out= call itself, for the fast path's common case, without boxing it: what fast_kernel does
// for `OP.out(self, other[, alpha], out=self)` (same signature key, so the same cost handle; same
// CPU kernel on the arguments' aliases; the same launch logged), or false when fast_kernel's checks
// would not all pass here (the caller then makes the boxed call, which takes it from there).
// `alpha`: nullptr for mul/div (no alpha argument).
template <class Cpu>
bool inplace_fast(const c10::OperatorHandle& out_op, at::Tensor& self, const at::Tensor& other,
                  const c10::Scalar* alpha, Cpu cpu) {
  if (!g_fast_master.load(std::memory_order_relaxed) || at::hasCallbacks() ||
      g_log_count.load(std::memory_order_relaxed) >= kLogMax || tracing() ||
      !g_fast_launch.load(std::memory_order_relaxed) || g_history.load() || self.numel() == 0) {
    return false;
  }
  const int index = self.device().index() < 0 ? 0 : self.device().index();
  thread_local std::string t_key;
  std::string& key = t_key;
  key.clear();
  key_int(key, reinterpret_cast<int64_t>(&out_op.schema()));
  key_tensor(key, self, 0);
  key_tensor(key, other, 0);
  if (alpha != nullptr) {  // as the boxed stack holds it (IValue(Scalar))
    if (alpha->isSymbolic()) return false;
    if (alpha->isFloatingPoint()) {
      key_int(key, 3);
    } else if (alpha->isComplex()) {
      key_int(key, 9);
    } else if (alpha->isBoolean()) {
      key_int(key, 4 + alpha->toBool());
    } else {
      key_int(key, 2);
      key_int(key, alpha->toLong());
    }
  }
  key_tensor(key, self, 0);  // out=self
  key_int(key, 13);  // (an out= that is an input: fast_kernel's mark)
  key_int(key, 50);
  const int64_t handle = cost_handle(key);
  if (handle < 0) return false;  // the boxed call learns it
  try {
    HostScope host;
    at::Tensor a = cpu_alias(self);
    at::Tensor b = other.unsafeGetTensorImpl() == self.unsafeGetTensorImpl() ? a : cpu_alias(other);
    cpu(a, b);
    c10::TensorImpl* dev = self.unsafeGetTensorImpl();  // an out= kernel may restride its output: as fast_kernel
    if (a.sizes() != dev->sizes() || a.strides() != dev->strides() || a.storage_offset() != dev->storage_offset()) {
      dev->set_sizes_and_strides(a.sizes(), a.strides(), a.storage_offset());
    }
  } catch (...) {
    return false;  // (kernels check their arguments before they write: the boxed call runs it again)
  }
  g_fast_hits++;
  log_entry(0, index, handle);
  return true;
}

const c10::OperatorHandle& out_handle(const char* name) {
  return *new c10::OperatorHandle(c10::Dispatcher::singleton().findSchemaOrThrow(name, "out"));
}

at::Tensor& inplace_add(at::Tensor& self, const at::Tensor& other, const c10::Scalar& alpha) {
  if (!plain_inplace(self, other) || !plain_alpha(self, alpha)) return at::compositeexplicitautogradnonfunctional::add_(self, other, alpha);
  static const c10::OperatorHandle& op = out_handle("aten::add");
  auto cpu = [&alpha](at::Tensor& a, const at::Tensor& b) {
    at::_ops::add_out::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), a, b, alpha, a);
  };
  if (!inplace_fast(op, self, other, &alpha, cpu)) at::_ops::add_out::call(self, other, alpha, self);
  return self;
}

at::Tensor& inplace_sub(at::Tensor& self, const at::Tensor& other, const c10::Scalar& alpha) {
  if (!plain_inplace(self, other) || !plain_alpha(self, alpha) || self.scalar_type() == c10::kBool) {  // (bool: sub's error, from its meta)
    return at::compositeexplicitautogradnonfunctional::sub_(self, other, alpha);
  }
  static const c10::OperatorHandle& op = out_handle("aten::sub");
  auto cpu = [&alpha](at::Tensor& a, const at::Tensor& b) {
    at::_ops::sub_out::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), a, b, alpha, a);
  };
  if (!inplace_fast(op, self, other, &alpha, cpu)) at::_ops::sub_out::call(self, other, alpha, self);
  return self;
}

at::Tensor& inplace_mul(at::Tensor& self, const at::Tensor& other) {
  if (!plain_inplace(self, other)) return at::compositeexplicitautogradnonfunctional::mul_(self, other);
  static const c10::OperatorHandle& op = out_handle("aten::mul");
  auto cpu = [](at::Tensor& a, const at::Tensor& b) {
    at::_ops::mul_out::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), a, b, a);
  };
  if (!inplace_fast(op, self, other, nullptr, cpu)) at::_ops::mul_out::call(self, other, self);
  return self;
}

at::Tensor& inplace_div(at::Tensor& self, const at::Tensor& other) {
  if (!plain_inplace(self, other) || !c10::isFloatingType(self.scalar_type())) {  // (integers: true division promotes)
    return at::compositeexplicitautogradnonfunctional::div_(self, other);
  }
  static const c10::OperatorHandle& op = out_handle("aten::div");
  auto cpu = [](at::Tensor& a, const at::Tensor& b) {
    at::_ops::div_out::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), a, b, a);
  };
  if (!inplace_fast(op, self, other, nullptr, cpu)) at::_ops::div_out::call(self, other, self);
  return self;
}

std::vector<std::unique_ptr<torch::Library>> g_libs;

// ---- the hooks ---------------------------------------------------------------------------------
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(g_device_count.load()); }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    check_index(d);
    t_device = d;
  }
  c10::DeviceIndex getCurrentDevice() const override { return t_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    c10::DeviceIndex old = t_device;
    if (d >= 0) setCurrentDevice(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kNeuron, t_device); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override { return default_generator(index); }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    if (index < 0) index = t_device;
    check_index(index);
    return at::make_generator<NeuronGenerator>(index, kDefaultSeed);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage(storage, newsize);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// torch.ops.trnsim.default_generator(i): the device's default generator as a torch.Generator
// (PyTorch has no Python accessor for a PrivateUse1 backend's default generators).
at::Generator default_generator_op(int64_t index) { return default_generator(static_cast<c10::DeviceIndex>(index)); }

// torch.ops.trnsim.cpu_views(ts): a CPU tensor over each neuron tensor's memory (memory.cpu_view, in
// one call for a compiled region's inputs; it does not own the memory). Only for strided tensors
// without conj/neg bits, over memory that exists; Python's cpu_view takes the others.
std::vector<at::Tensor> cpu_views_op(at::TensorList ts) {
  AliasScope scope;  // views of one memory share a CPU storage, as Python's cpu_view gives them
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) {
    TORCH_CHECK(t.defined() && t.device().type() == kNeuron && t.layout() == c10::kStrided && !t.is_conj() &&
                    !t.is_neg() && t.storage().nbytes() > 0,
                "trnsim.cpu_views: a strided neuron tensor over memory, without conj/neg bits, was expected");
    out.push_back(cpu_alias(t));
  }
  return out;
}

// torch.ops.trnsim.adopt(cpu, index): the fresh host tensor `cpu` as a neuron:index tensor over the
// same memory, counted against HBM (memory.relabel's effect, as the fast path's results are counted);
// None when it does not fit (memory.relabel raises the OOM), while memory history records, or for a
// tensor relabel treats specially (one that requires grad, conj/neg bits, not strided on the host).
std::optional<at::Tensor> adopt_op(const at::Tensor& cpu, int64_t index) {
  if (!cpu.defined() || !cpu.device().is_cpu() || cpu.layout() != c10::kStrided || cpu.is_conj() || cpu.is_neg() ||
      cpu.requires_grad() || g_history.load() || index < 0) {
    return std::nullopt;
  }
  FastBlock* block = count_block(cpu, static_cast<int>(index));
  if (block == nullptr) return std::nullopt;
  return to_device(cpu, block, static_cast<int>(index));
}

// torch.ops.trnsim.datapath_f32(a, b): torch_bridge.tensore.matmul_f32 (a [M, K] @ b [K, N]) or
// bmm_f32 (a [B, M, K] @ b [B, K, N]) of host tensors, as float32 PSUM results, by the datapath
// called with the arguments fast_matmul passes it (a read transposed as the stationary operand; the
// same bits as trnsim.native.matmul/matmul_batched give, whatever the strides). None for anything
// else (host tensors of one datapath dtype, non-empty, shapes that multiply), when the datapath is
// not registered, TRNSIM_NATIVE=0 (the numpy reference), a TRNSIM_NATIVE_THREADS Python must refuse,
// or an error: the Python route then computes, or raises, as before. It saves that route's numpy
// views and operand checks (~15 us of a small attention head's 20 us).
std::optional<at::Tensor> datapath_f32_op(const at::Tensor& a, const at::Tensor& b) {
  Datapath dp;
  if (!datapath_ready(&dp)) return std::nullopt;
  const int64_t dim = a.defined() ? a.dim() : 0;
  for (const at::Tensor* t : {&a, &b}) {
    if (!t->defined() || !t->device().is_cpu() || t->layout() != c10::kStrided || t->is_conj() || t->is_neg() ||
        t->dim() != dim || t->numel() == 0 || t->scalar_type() != a.scalar_type()) {
      return std::nullopt;
    }
  }
  const int code = datapath_code(a.scalar_type());
  if ((dim != 2 && dim != 3) || code < 0) return std::nullopt;
  const int64_t B = dim == 3 ? a.size(0) : 1, M = a.size(dim - 2), K = a.size(dim - 1), N = b.size(dim - 1);
  if (b.size(dim - 2) != K || (dim == 3 && b.size(0) != B)) return std::nullopt;
  at::Tensor out;
  try {
    out = dim == 3 ? psum_result({B, M, N}) : psum_result({M, N});
  } catch (...) {
    return std::nullopt;
  }
  if (datapath_matmul(dp, a, b, code, dim, out) != 0) return std::nullopt;
  return out;
}

// A torch function or dispatch mode is active on this thread: it sees the ATen calls Python makes,
// so a native op that would make them from C++ leaves the call to Python.
bool modes_active() {
  return at::impl::PythonTorchFunctionTLS::stack_len() > 0 || c10::impl::TorchDispatchModeTLS::stack_len() > 0;
}

// torch.ops.trnsim.sdpa_values(q, k, v, mask, scale, groups): ops/attention.py's forward_values
// for a call without is_causal whose values are the datapath's (datapath_exact), as [out, P] host
// tensors: the same ATen calls in the same order, on the same host views, from C++ (a decode step's
// ~17 small host ops took ~180 us from Python, ~50 us here, measured). An empty list where Python's
// own path must run: a torch function or dispatch mode active (they see Python's calls), a tensor the
// host views do not take, operands whose values are CPU's kernel's (datapath_exact false), or a
// product the datapath call does not take (Python's route computes the same bits, or raises).
std::vector<at::Tensor> sdpa_values_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const std::optional<at::Tensor>& mask, std::optional<double> scale,
                                       int64_t groups) {
  if (modes_active() || groups < 1) return {};
  const bool masked = mask.has_value() && mask->defined();
  c10::SmallVector<const at::Tensor*, 4> devs{&q, &k, &v};
  if (masked) devs.push_back(&*mask);
  for (const at::Tensor* t : devs) {
    if (!t->defined() || t->device().type() != kNeuron || t->layout() != c10::kStrided || t->is_conj() ||
        t->is_neg() || t->storage().nbytes() == 0 || t->dim() < 1) {
      return {};
    }
  }
  if (q.dim() < 3) return {};
  AliasScope scope;  // views of one memory share a CPU storage (memory.cpu_views)
  const at::Tensor hq = cpu_alias(q), hk = cpu_alias(k), hv = cpu_alias(v);
  const at::Tensor hmask = masked ? cpu_alias(*mask) : at::Tensor();
  const int64_t l = q.size(-2), e = q.size(-1), s = k.size(-2);
  if (e <= 0) return {};
  // datapath_exact
  const double sc = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(e));
  if (!(std::isfinite(sc) && sc > 0)) return {};
  if (masked && hmask.is_floating_point() && hmask.numel() &&
      !(hmask.amax().item<double>() < std::numeric_limits<double>::infinity())) {
    return {};
  }
  if (!(static_cast<double>(e) * magnitude(hq) * magnitude(hk) * std::fabs(sc) + 0.0 < kBound) ||
      !(static_cast<double>(s) * magnitude(hv) < kBound)) {
    return {};
  }
  // the scores: Q Kᵀ on the datapath, scaled, the mask added (masked_scores without is_causal)
  std::optional<at::Tensor> raw =
      datapath_f32_op(hq.reshape({-1, groups * l, e}), hk.reshape({-1, s, e}).transpose(1, 2));
  if (!raw.has_value()) return {};
  std::vector<int64_t> score_sizes(q.sizes().begin(), q.sizes().end());
  score_sizes.back() = s;
  at::Tensor scores = raw->view(score_sizes);
  scores.mul_(sc);
  if (masked) {
    scores = scores + (hmask.scalar_type() == c10::kBool
                           ? at::zeros(hmask.sizes(), at::TensorOptions().dtype(c10::kFloat))
                                 .masked_fill_(hmask.logical_not(), -std::numeric_limits<double>::infinity())
                           : hmask.to(c10::kFloat));
  }
  at::Tensor p = scores.softmax(-1);
  if (masked) {  // a row that sees no key is zeros, as CPU's kernels write it
    at::Tensor dead = scores.amax({-1}, true).eq(-std::numeric_limits<double>::infinity());
    if (dead.any().item<bool>()) p.masked_fill_(dead, 0.0);
  }
  std::optional<at::Tensor> out =
      datapath_f32_op(p.to(q.scalar_type()).reshape({-1, groups * l, s}), hv.reshape({-1, s, e}));
  if (!out.has_value()) return {};
  return {out->view(q.sizes()).to(q.scalar_type()), p};
}

// ops/moe.py's linears as the device computes them. On the datapath (_datapath_linear): the
// datapath's fp32 result of x @ w.t() cast to x's dtype where it is finite or the operands' products
// cannot overflow (tensore.datapath_product), else CPU's mm; undefined where the datapath call does
// not take it (Python's route must decide). Off it: F.linear (_forward_linear, the backward's
// recompute), or with `forward` CPU's mm (_datapath_linear itself, the forward's).
at::Tensor moe_linear(const at::Tensor& x, const at::Tensor& w, bool forward = false) {
  const c10::ScalarType dt = x.scalar_type();
  const bool on_datapath = (dt == c10::kFloat || dt == c10::kBFloat16 || dt == c10::kHalf) && w.scalar_type() == dt &&
                           x.numel() > 0 && w.numel() > 0;
  const at::Tensor wt = w.t();
  if (!on_datapath) return forward ? x.mm(wt) : at::linear(x, w);
  std::optional<at::Tensor> p = datapath_f32_op(x, wt);
  if (!p.has_value()) return at::Tensor();
  if (all_finite_f32(p->const_data_ptr<float>(), p->numel()) ||  // (psum_result: contiguous)
      static_cast<double>(x.size(-1)) * magnitude(x) * magnitude(wt) * 1.0 + 0.0 < kBound) {
    return p->to(dt);
  }
  return x.mm(wt);
}

// torch.ops.trnsim.moe_forward_values(...): ops/moe.py's block_values with _datapath_linear and
// without autocast dtypes, on host tensors, as [out, logits]: the same ATen calls in the same order
// from C++ (the experts as ints: _experts_hit without a dispatch mode). An empty list where Python's
// own path must run (as moe_backward_values).
std::vector<at::Tensor> moe_forward_values_op(const at::Tensor& x, const at::Tensor& router_weight,
                                              const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                                              int64_t top_k, bool normalize) {
  if (modes_active()) return {};
  for (const at::Tensor* t : {&x, &router_weight, &gate_up_proj, &down_proj}) {
    if (!t->defined() || !t->device().is_cpu() || t->layout() != c10::kStrided) return {};
  }
  const at::Tensor logits = moe_linear(x, router_weight, true);
  if (!logits.defined()) return {};
  const at::Tensor probs = logits.to(c10::kFloat).softmax(-1);
  auto [weights, index] = at::topk(probs, top_k, -1);
  if (normalize) weights.div_(weights.sum({-1}, true));
  const int64_t experts = gate_up_proj.size(0);
  at::Tensor out = at::zeros_like(x);
  at::Tensor mask, hit;
  {
    at::NoGradGuard no_grad;
    mask = at::one_hot(index, experts + 1).permute({2, 1, 0});
    hit = at::greater(mask.sum({-1, -2}), 0).nonzero().flatten().contiguous();
  }
  for (int64_t i = 0; i < hit.numel(); ++i) {
    const int64_t e = hit.const_data_ptr<int64_t>()[i];
    if (e == experts) continue;
    std::vector<at::Tensor> where = at::where(mask.select(0, e));
    c10::List<std::optional<at::Tensor>> by_tok, by_tok_pos;
    by_tok.push_back(where[1]);
    by_tok_pos.push_back(where[1]);
    by_tok_pos.push_back(where[0]);
    const at::Tensor state = at::index(x, by_tok);
    const at::Tensor gate_up = moe_linear(state, gate_up_proj.select(0, e), true);
    if (!gate_up.defined()) return {};
    std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
    at::Tensor h = moe_linear(at::silu(halves[0]) * halves[1], down_proj.select(0, e), true);
    if (!h.defined()) return {};
    h = h * at::index(weights, by_tok_pos).unsqueeze(-1);
    out.index_add_(0, where[1], h.to(out.scalar_type()));
  }
  return {out, logits};
}

// torch.ops.trnsim.moe_backward_values(...): ops/moe.py's _direct_backward without autocast dtypes,
// on host tensors, as [gx, g_router, g_gate_up, g_down]: the same ATen calls in the same order from
// C++ (a 4-expert block's ~110 small host ops took ~2.3 ms from Python). An empty list where
// Python's own path must run: a torch function or dispatch mode active (they see Python's calls),
// or a linear the datapath call does not take.
std::vector<at::Tensor> moe_backward_values_op(const at::Tensor& x, const at::Tensor& router_weight,
                                               const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                                               const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_logits,
                                               int64_t top_k, bool normalize) {
  if (modes_active()) return {};
  for (const at::Tensor* t : {&x, &router_weight, &gate_up_proj, &down_proj, &grad_out}) {
    if (!t->defined() || !t->device().is_cpu() || t->layout() != c10::kStrided) return {};
  }
  const at::Tensor logits = moe_linear(x, router_weight);
  if (!logits.defined()) return {};
  const at::Tensor probs = logits.to(c10::kFloat).softmax(-1);
  auto [raw, index] = at::topk(probs, top_k, -1);
  const at::Tensor total = normalize ? raw.sum({-1}, true) : at::Tensor();
  const at::Tensor weights = normalize ? raw / total : raw;
  const int64_t experts = gate_up_proj.size(0);
  at::Tensor gx = at::zeros_like(x);
  at::Tensor g_gate_up = at::zeros_like(gate_up_proj);
  at::Tensor g_down = at::zeros_like(down_proj);
  at::Tensor g_weights = at::zeros_like(weights);
  const at::Tensor mask = at::one_hot(index, experts + 1).permute({2, 1, 0});
  const at::Tensor hit = at::greater(mask.sum({-1, -2}), 0).nonzero().flatten().contiguous();
  std::vector<int64_t> ran;
  for (int64_t i = 0; i < hit.numel(); ++i) {
    const int64_t e = hit.const_data_ptr<int64_t>()[i];
    if (e != experts) ran.push_back(e);
  }
  for (auto it = ran.rbegin(); it != ran.rend(); ++it) {  // autograd reaches the last expert's ops first
    const int64_t e = *it;
    std::vector<at::Tensor> where = at::where(mask.select(0, e));
    const at::Tensor& pos = where[0];
    const at::Tensor& tok = where[1];
    c10::List<std::optional<at::Tensor>> by_tok;
    by_tok.push_back(tok);
    const at::Tensor state = at::index(x, by_tok);
    const at::Tensor w_gate_up = gate_up_proj.select(0, e), w_down = down_proj.select(0, e);
    const at::Tensor gate_up = moe_linear(state, w_gate_up);
    if (!gate_up.defined()) return {};
    std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
    const at::Tensor& gate = halves[0];
    const at::Tensor& up = halves[1];
    const at::Tensor act = at::silu(gate);
    const at::Tensor mid = act * up;
    const at::Tensor h = moe_linear(mid, w_down);
    if (!h.defined()) return {};
    c10::List<std::optional<at::Tensor>> by_tok_pos;
    by_tok_pos.push_back(tok);
    by_tok_pos.push_back(pos);
    const at::Tensor scale = at::index(weights, by_tok_pos).unsqueeze(-1);
    const at::Tensor g = at::index(grad_out, by_tok).to(at::result_type(h, scale));
    g_weights.index_put_(by_tok_pos, (g * h).sum({-1}), true);
    const at::Tensor g_h = (g * scale).to(h.scalar_type());
    const at::Tensor g_mid = g_h.mm(w_down), g_w_down = g_h.t().mm(mid);
    const at::Tensor g_gate = at::silu_backward(g_mid * up, gate);
    const at::Tensor both = at::cat({g_gate, g_mid * act}, -1);
    const at::Tensor g_state = both.mm(w_gate_up), g_w_gate_up = both.t().mm(state);
    g_gate_up.select(0, e).copy_(g_w_gate_up);
    g_down.select(0, e).copy_(g_w_down);
    gx.index_add_(0, tok, g_state.to(x.scalar_type()));
  }
  if (ran.size() > 1) {  // autograd sums the experts' whole-weight gradients: 0 + -0 is +0
    g_gate_up.add_(0.0);
    g_down.add_(0.0);
  }
  const at::Tensor g_raw = normalize ? g_weights / total + (-g_weights * ((raw / total) / total)).sum({-1}, true)
                                     : g_weights;
  const at::Tensor g_probs = at::zeros_like(probs).scatter(-1, index, g_raw);
  at::Tensor g_logits = at::_softmax_backward_data(g_probs, probs, -1, c10::kFloat).to(logits.scalar_type());
  if (grad_logits.has_value() && grad_logits->defined()) g_logits = g_logits + *grad_logits;
  const at::Tensor g_xr = g_logits.mm(router_weight), g_wr = g_logits.t().mm(x);
  gx = gx + g_xr.to(x.scalar_type());
  return {gx, g_wr.to(router_weight.scalar_type()), g_gate_up, g_down};
}

TORCH_LIBRARY(trnsim, m) {
  m.def("default_generator(int index) -> Generator?", &default_generator_op);
  m.def("cpu_views(Tensor[] ts) -> Tensor[]", &cpu_views_op);
  m.def("adopt(Tensor cpu, int index) -> Tensor?", &adopt_op);
  m.def("datapath_f32(Tensor a, Tensor b) -> Tensor?", &datapath_f32_op);
  m.def("sdpa_values(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale, int groups) -> Tensor[]",
        &sdpa_values_op);
  m.def("moe_backward_values(Tensor x, Tensor router_weight, Tensor gate_up_proj, Tensor down_proj, Tensor grad_out, "
        "Tensor? grad_logits, int top_k, bool normalize) -> Tensor[]",
        &moe_backward_values_op);
  m.def("moe_forward_values(Tensor x, Tensor router_weight, Tensor gate_up_proj, Tensor down_proj, int top_k, "
        "bool normalize) -> Tensor[]",
        &moe_forward_values_op);
}

// ---- placing the log's launches (trnsim.device.Device._drain, the common case) ----
// The device model issues a logged launch on a core whose stream 0 has the core to itself (no
// collective awaits its group) with a few lines of arithmetic: the host pays its dispatch (after
// waiting for the oldest of max_inflight launches in flight), the kernel starts when the host and
// the stream are both ready. This runs that arithmetic for the log's first entries, in order, and
// hands back what changed, aggregated (per core, per cost handle, per host op), for Python to apply
// to the device's state and its recorders: the same numbers its per-launch loop computes, without a
// Python loop per launch. Each handle's ticks (OpCost.ticks) are told once (trnsim_fast_ticks).
std::mutex g_ticks_mutex;
std::vector<int64_t> g_ticks;  // cost handle -> its OpCost.ticks (-1: not told)

constexpr int kPlaceIn = 16;    // per core in io: simple, max_inflight, ready0, busy_until, n_inflight,
                                // inflight[8], last open end (any recorder), the last end of another
                                // stream's booked kernel, the latest ready of its other streams
constexpr int kPlaceOut = 64;   // per core out: core, launches, wait, ticks, max end, last host, folded,
                                // n survivors, survivors[2 * 12], n bookings, bookings[3 * 9]
constexpr int kSurvivors = 12, kBookings = 9, kInflight = 8;

}  // namespace trnsim_neuron

// ---- torch.autocast("neuron") -----------------------------------------------------------------
// The policy every other accelerator's autocast follows (CUDA, XPU, MPS, MTIA: PyTorch's shared op
// lists in ATen/autocast_mode.h, "so other backends can reuse" them): TensorE ops in the autocast
// dtype, the precision-sensitive ones (exp, pow, norms, softmax and log_softmax, the losses, ...)
// in float32, the ops that mix inputs at the widest input type. With only the first list the
// device ran a bf16 model's cross-entropy on bf16 logits: DistilBERT's loss 8e-3 off where CPU's
// autocast is 4e-5 off (now 3e-5). Other ops fall through (torch_bridge.eager.autocast registers
// the fallback).
namespace at::autocast {  // (the lists name Tensor, Scalar, ... unqualified, as autocast_mode.cpp reads them)
TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define TRNSIM_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TRNSIM_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TRNSIM_FP32_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TRNSIM_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(TRNSIM_LOWER)
  AT_FORALL_FP32(TRNSIM_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TRNSIM_FP32_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(TRNSIM_PROMOTE)
  // as XPU's and CPU's autocast add them: cross_entropy's own decomposition asks log_softmax for
  // the logits' dtype, so without it a bf16 model's loss was a bf16 log_softmax (1e-3 off)
  KERNEL_PRIVATEUSEONE(binary_cross_entropy, fp32)
  KERNEL_PRIVATEUSEONE(cross_entropy_loss, fp32)
  KERNEL_PRIVATEUSEONE(nll_loss_nd, fp32)
#undef TRNSIM_LOWER
#undef TRNSIM_FP32
#undef TRNSIM_FP32_DTYPE
#undef TRNSIM_PROMOTE
}
}  // namespace at::autocast

using namespace trnsim_neuron;

extern "C" {

// Register the hooks (once per process; PyTorch accepts one registration). Returns 0 on
// success, 1 if some other PrivateUse1 hooks were registered first.
int trnsim_register_hooks() {
  if (at::isPrivateUse1HooksRegistered()) return 1;
  static Hooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  c10::SetAllocator(kNeuron, &g_device_allocator);
  return 0;
}

void trnsim_set_device_count(int count) { g_device_count.store(count > 0 ? count : 1); }
int trnsim_device_count() { return g_device_count.load(); }
int trnsim_current_device() { return t_device; }

// Returns 0, or -1 when `index` does not exist (the caller names it in its error).
int trnsim_set_device(int index) {
  if (index < 0 || index >= g_device_count.load()) return -1;
  t_device = static_cast<c10::DeviceIndex>(index);
  return 0;
}

void trnsim_set_allocator(AllocFn alloc, ReleaseFn release) {
  g_alloc = alloc;
  g_release = release;
}

int trnsim_is_pinned(const void* data) { return is_pinned(data) ? 1 : 0; }
int64_t trnsim_pinned_bytes() { return g_pinned_bytes.load(); }
int64_t trnsim_pinned_allocations() { return g_pinned_allocs.load(); }

// ---- the host cache (see above) ----
void trnsim_host_scope(int delta) { host_scope(delta); }
int64_t trnsim_host_release() { return host_release_all(); }
// [installed, bytes kept free, limit, allocations reused, fresh allocations, blocks owned,
//  the smallest block it serves]
void trnsim_host_stats(int64_t* out) {
  std::lock_guard<std::mutex> lock(g_host.mutex);
  out[0] = g_host_on.load() ? 1 : 0;
  out[1] = g_host.kept;
  out[2] = g_host.limit;
  out[3] = g_host.reused;
  out[4] = g_host.fresh;
  out[5] = static_cast<int64_t>(g_host.owned.size());
  out[6] = static_cast<int64_t>(kCacheMin);
}


// ---- the fast path and the ledger (see above) ----
// the overloads Python's path screens (NUL-separated "op.overload" names: screened(), above)
void trnsim_fast_screen(const char* names, int64_t len) {
  std::lock_guard<std::mutex> lock(g_fast_mutex);
  std::string all(names, static_cast<size_t>(len));
  size_t at = 0;
  while (at < all.size()) {
    size_t end = all.find('\0', at);
    if (end == std::string::npos) end = all.size();
    if (end > at) screened().insert(all.substr(at, end - at));
    at = end + 1;
  }
}
// register the fast kernel: the PrivateUse1 fallback, and `names` (NUL-separated aten
// "op.overload" names) whose own PrivateUse1 kernel it is; their Python kernels go to PrivateUse2
int trnsim_fast_register(const char* names, int64_t len) {
  if (!g_libs.empty()) return 0;
  try {
    auto fb = std::make_unique<torch::Library>(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1, __FILE__,
                                               __LINE__);
    fb->fallback(torch::CppFunction::makeFromBoxedFunction<&fast_kernel>());
    auto impl = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                                 __LINE__);
    std::string all(names, static_cast<size_t>(len));
    size_t at = 0;
    while (at < all.size()) {
      size_t end = all.find('\0', at);
      if (end == std::string::npos) end = all.size();
      std::string name = all.substr(at, end - at);
      if (!name.empty()) impl->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fast_kernel>());
      at = end + 1;
    }
    impl->impl("add_.Tensor", TORCH_FN(inplace_add));
    impl->impl("sub_.Tensor", TORCH_FN(inplace_sub));
    impl->impl("mul_.Tensor", TORCH_FN(inplace_mul));
    impl->impl("div_.Tensor", TORCH_FN(inplace_div));
    g_libs.push_back(std::move(fb));
    g_libs.push_back(std::move(impl));
  } catch (const std::exception&) {
    return 1;
  }
  return 0;
}
void trnsim_fast_enable(int on) { g_fast_master.store(on); }
// the datapath entry point (trnsim.native.batched_entry) and the chip's contraction rows per instruction
void trnsim_fast_datapath(void* batched, int f32_code, int f16_code, int bf16_code, int fma_on, int64_t k_chunk) {
  g_f32_code.store(f32_code);
  g_f16_code.store(f16_code);
  g_bf16_code.store(bf16_code);
  g_fma_on.store(fma_on);
  g_k_chunk.store(k_chunk);
  g_batched.store(reinterpret_cast<BatchedFn>(batched));
}
int64_t trnsim_fast_datapath_ns() { return g_datapath_ns.load(); }
// Log one launch of `handle` on `core` as the fast path logs its ops' (inside a graph capture: collected
// there), for Python code that would otherwise call Device.launch (a compiled region's fused kernel);
// 0 when the fast path would not log it (off, the device's gate closed, torch.profiler, memory
// history, torch.compile tracing, the log full): the caller launches it from Python then.
// Whether Python may log launches on `core` now, the log holding fewer than kLogMax - `more` entries
// (trnsim_fast_launch's and trnsim_fast_launch_many's conditions, in one place)
bool python_launch_open(int64_t core, int64_t more) {
  return g_fast_master.load(std::memory_order_relaxed) && g_fast_launch.load(std::memory_order_relaxed) &&
         !g_history.load() && !at::hasCallbacks() && g_log_count.load(std::memory_order_relaxed) + more < kLogMax &&
         !tracing() && core >= 0;
}
int trnsim_fast_launch(int64_t core, int64_t handle) {
  if (!python_launch_open(core, 0) || handle < 0) return 0;
  log_entry(0, core, handle);
  return 1;
}
// trnsim_fast_launch of `count` handles in order, logged under one lock (an op replaying the launches
// its composite would make: torch_bridge.ops.rnn); 0, none logged, where trnsim_fast_launch would log
// none now or the log has no room for them all (the caller launches them one by one)
int trnsim_fast_launch_many(int64_t core, const int64_t* handles, int64_t count) {
  if (count < 1 || !python_launch_open(core, count)) return 0;
  const int64_t kind = t_capture != 0 ? 2 + t_capture : 0;  // (log_entry's kind of a launch)
  std::lock_guard<std::mutex> lock(g_log_mutex);
  for (int64_t i = 0; i < count; ++i) {
    g_log.push_back(kind);
    g_log.push_back(core);
    g_log.push_back(handles[i]);
  }
  g_log_count.store(static_cast<int64_t>(g_log.size() / 3));
  return 1;
}
int trnsim_fast_all_finite(const float* p, int64_t n) { return all_finite_f32(p, n) ? 1 : 0; }  // (for tests)
// max |x| of n contiguous floats at p (code 0: float32, 1: bfloat16, 2: float16) as a double, NaN
// when one is NaN, inf when one is infinite: torch_bridge.tensore.magnitude's value in one pass
// (its aminmax made two of a tensor and a reduction's set-up; attention's exactness check reads
// Q, K and V on every call)
double trnsim_fast_max_abs(const void* p, int64_t n, int code) {
  if (code == 0) {
    uint32_t top = top_bits(p, n, uint32_t{0x7fffffffu});
    if (top > 0x7f800000u) return std::nan("");
    float f;
    std::memcpy(&f, &top, sizeof f);
    return f;
  }
  uint16_t top = top_bits(p, n, uint16_t{0x7fff});
  if (code == 1) {
    if (top > 0x7f80) return std::nan("");
    uint32_t w = static_cast<uint32_t>(top) << 16;
    float f;
    std::memcpy(&f, &w, sizeof f);
    return f;
  }
  if (top > 0x7c00) return std::nan("");
  return static_cast<float>(c10::Half(top, c10::Half::from_bits()));
}
// trn_conv2d_grouped (trnsim.native.grouped_entry), for the fast path's convolutions
void trnsim_fast_conv_datapath(void* grouped) { g_grouped.store(reinterpret_cast<GroupedFn>(grouped)); }
void trnsim_fast_gate(int on) { g_fast_launch.store(on); }
void trnsim_fast_tracing(int on) { t_tracing = on; }  // (the calling thread's)
void trnsim_fast_capture(int64_t token) { t_capture = token; }  // (the calling thread's)
// How the fast path classifies op `name` ("aten::add"), overload `overload` ("Tensor", "" for the
// default): its OpKind (0: never served), or -1 where no such op is registered. Tests use it to hold
// every op it serves to what its schema says it writes.
int trnsim_fast_kind(const char* name, const char* overload) {
  auto handle = c10::Dispatcher::singleton().findSchema(c10::OperatorName(name, overload));
  if (!handle.has_value()) return -1;
  return static_cast<int>(op_fast(*handle).kind);
}
void trnsim_fast_history(int on) { g_history.store(on); }
int64_t trnsim_fast_hits() { return g_fast_hits.load(); }
int64_t* trnsim_log_count_ptr() { return reinterpret_cast<int64_t*>(&g_log_count); }
int64_t trnsim_log_take(int64_t* out, int64_t cap) {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  int64_t n = std::min<int64_t>(static_cast<int64_t>(g_log.size() / 3), cap);
  std::memcpy(out, g_log.data(), static_cast<size_t>(n) * 3 * sizeof(int64_t));
  erase_log_locked(n);
  return n;
}
// Capture `token` learns its host ops (Device.recorded) while `on`: the native prefixes stop at them.
void trnsim_log_learning(int64_t token, int on) {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  if (on != 0) {
    g_learning.insert(token);
  } else {
    g_learning.erase(token);
  }
}
// Device.graph's (or, `keep` 0, Device.muted's) block ends on this thread: capture `token` is closed here in
// the log (kind -2), all its launches logged before it, to be issued (or dropped) where the close stands.
// 0 (nothing logged) when the log is full: the device then collects and issues them itself.
int trnsim_log_close(int64_t token, int keep) {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  if (static_cast<int64_t>(g_log.size() / 3) >= kLogMax || token <= 0) return 0;
  g_log.push_back(-2);
  g_log.push_back(token);
  g_log.push_back(keep != 0 ? 1 : 0);
  ++g_log_closes;
  g_log_count.store(static_cast<int64_t>(g_log.size() / 3));
  return 1;
}
// The log's first entries while they are launches made inside a graph capture still open (kind 2 +
// token; a closed one's are placed at its close) or host ops: the launches, in order, as (core, cost
// handle, token) into `launches` (at most `cap`),
// the host ops counted as HostOpCounts pairs into `hops`. counts[0], counts[1]: how many of each were
// written. Returns the entries consumed. What Device._drain's loop does with these entries is to
// collect the launches into their capture and count the host ops, neither of which depends on the
// entries' order across the two kinds.
int64_t trnsim_log_take_captured(int64_t* launches, int64_t cap, int64_t* hops, int64_t* counts) {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  const int64_t n = static_cast<int64_t>(g_log.size() / 3);
  int64_t i = 0, nl = 0;
  HostOpCounts hop;
  std::unordered_set<int64_t> closed;
  if (g_log_closes > 0) {
    for (int64_t j = 0; j < n; ++j) {
      if (g_log[3 * j] == -2) closed.insert(g_log[3 * j + 1]);
    }
  }
  for (; i < n; ++i) {
    const int64_t kind = g_log[3 * i], core = g_log[3 * i + 1], id = g_log[3 * i + 2];
    if (kind == 1) {
      if (core != 0 && g_learning.count(core) != 0) break;  // made inside Device.recorded: Python's loop learns it
      hop.add(id);
      continue;
    }
    if (kind < 2 || nl == cap || closed.count(kind - 2) != 0) break;
    launches[3 * nl] = core;
    launches[3 * nl + 1] = id;
    launches[3 * nl + 2] = kind - 2;
    ++nl;
  }
  erase_log_locked(i);
  counts[0] = nl;
  counts[1] = hop.write(hops);
  return i;
}
void trnsim_fast_ticks(int64_t handle, int64_t ticks) {
  std::lock_guard<std::mutex> lock(g_ticks_mutex);
  if (handle < 0) return;
  if (static_cast<size_t>(handle) >= g_ticks.size()) g_ticks.resize(static_cast<size_t>(handle) + 1, -1);
  g_ticks[static_cast<size_t>(handle)] = ticks;
}

// io: [0] host (in/out), [1] dispatch, [2] cores, [3..5] out: the counts below; then kPlaceIn int64
// per core from io[8] (ready0, busy_until and the in-flight ends written back). Out: one kPlaceOut row
// per core the entries used, in first-use order, into cores_out (io[3] of them); (handle, launches,
// ticks, wait) per handle in first-use order into rows (io[4]); (name id, count) per host op into
// hops (io[5]); the ticks the host waited at kind -1 entries (io[6]); the captures' ends (kind -2) it
// took (io[7]). A graph capture closed in the log (kind -2, trnsim_log_close) is placed at its close: its launches
// (kind 2 + token, wherever they stand before it) as Device._settle_capture issues them, one dispatch
// per run of consecutive launches on a core, the kernels of a run back to back (Device._issue_run).
// Its launches are consumed only with its close: a stop between them gives the placement back to
// where the first of them stood (Python's loop takes it from there).
// Returns the entries consumed (0: the first one is not the common case; Python's loop takes it),
// or -1 when a core's figures do not fit the rows (nothing consumed).
int64_t trnsim_log_place(int64_t* io, int64_t* cores_out, int64_t* rows, int64_t* hops) {
  int64_t* ncores_out = io + 3;
  int64_t* nrows = io + 4;
  int64_t* nhops = io + 5;
  struct Core {
    bool simple = false, used = false;
    int64_t max_inflight = 0, ready0 = 0, busy = 0, last_open = 0;
    int64_t others = 0, ready_other = 0;  // other streams: their kernels' last end (booked), their latest ready
    std::vector<int64_t> inflight;  // front = oldest
    int64_t launches = 0, wait = 0, ticks = 0, max_end = 0, last_host = -1, order = -1;
    int64_t dispatches = 0, graphs = 0;             // host dispatches; graph launches (runs of 2+ kernels)
    std::vector<std::pair<int64_t, int64_t>> fresh;  // new intervals with end > start, in order
    std::vector<int64_t> bookings;                  // (start, end, handle) of the last kBookings ticking kernels
  };
  struct State {  // everything the placement has done so far (a closed capture's checkpoint copies it)
    std::vector<Core> cs;
    int64_t host = 0, waited = 0;  // waited: ticks the host spent in kind -1 waits (apart from host_ticks)
    int64_t closes = 0;            // captures' ends placed
    std::vector<int64_t> order;
    std::unordered_map<int64_t, size_t> row_at;
    std::vector<int64_t> row_v;
    HostOpCounts hop;
  };
  const int64_t ncores = io[2];
  if (ncores < 1 || ncores > 64) return 0;
  const int64_t dispatch = io[1];
  State st;
  st.host = io[0];
  st.cs.resize(static_cast<size_t>(ncores));
  for (int64_t i = 0; i < ncores; ++i) {
    const int64_t* in = io + 8 + i * kPlaceIn;
    Core& c = st.cs[static_cast<size_t>(i)];
    c.simple = in[0] != 0 && in[4] <= kInflight && in[1] >= 1 && in[1] + 1 <= kBookings;
    c.max_inflight = in[1];
    c.ready0 = in[2];
    c.busy = in[3];
    if (c.simple) c.inflight.assign(in + 5, in + 5 + in[4]);
    c.last_open = in[13];
    c.others = in[14];
    c.ready_other = in[15];
  }
  auto use = [&st](Core& c, int64_t core) {
    if (!c.used) {
      c.used = true;
      c.order = static_cast<int64_t>(st.order.size());
      st.order.push_back(core);
    }
  };
  auto row = [&st](int64_t id, int64_t ticks, int64_t wait) {
    auto it = st.row_at.find(id);
    if (it == st.row_at.end()) {
      st.row_at.emplace(id, st.row_v.size());
      st.row_v.insert(st.row_v.end(), {id, 1, ticks, wait});
    } else {
      st.row_v[it->second + 1] += 1;
      st.row_v[it->second + 2] += ticks;
      st.row_v[it->second + 3] += wait;
    }
  };
  auto book = [](Core& c, int64_t start, int64_t end, int64_t id) {
    c.bookings.push_back(start);
    c.bookings.push_back(end);
    c.bookings.push_back(id);
  };
  // The host dispatches to core c (Device._dispatch): its tick after, and whether the oldest in-flight
  // launch leaves the queue.
  auto dispatch_to = [&st, dispatch](const Core& c, bool* pop) {
    int64_t h = st.host;
    *pop = static_cast<int64_t>(c.inflight.size()) >= c.max_inflight;
    if (*pop && c.inflight.front() > h) h = c.inflight.front();
    return h + dispatch;
  };
  // one launch of `id` on `core`, as Device._drain places it; false where Python's loop must
  auto launch = [&](int64_t core, int64_t id) {
    if (core < 0 || core >= ncores || id < 0 || static_cast<size_t>(id) >= g_ticks.size()) return false;
    Core& c = st.cs[static_cast<size_t>(core)];
    const int64_t ticks = g_ticks[static_cast<size_t>(id)];
    if (!c.simple || ticks < 0) return false;
    bool pop;
    const int64_t h = dispatch_to(c, &pop);
    const int64_t start = c.ready0 > h ? c.ready0 : h;
    int64_t wait = h - (c.ready0 > c.busy ? c.ready0 : c.busy);
    if (wait < 0) wait = 0;
    const int64_t end = start + ticks;
    if (end > start && c.last_open > start) return false;  // overlaps an open interval: the general merge (Python's)
    if (c.others > start) return false;  // beside another stream's kernel: they share the engines (Device._book)
    if (pop) c.inflight.erase(c.inflight.begin());
    st.host = h;
    use(c, core);
    if (ticks) book(c, start, end, id);
    row(id, ticks, wait);
    c.launches += 1;
    c.wait += wait;
    c.dispatches += 1;
    if (end > c.max_end) c.max_end = end;
    if (end > start) {
      c.ticks += end - start;
      c.last_host = h;
      c.fresh.emplace_back(start, end);
      c.last_open = end;
      c.inflight.push_back(end);
    }
    c.ready0 = end;
    if (end > c.busy) c.busy = end;
    return true;
  };
  // a run of 2+ launches on `core` as one graph launch (Device._issue_run); false where Python must
  auto graph_run = [&](int64_t core, const std::vector<int64_t>& ids) {
    if (core < 0 || core >= ncores) return false;
    Core& c = st.cs[static_cast<size_t>(core)];
    if (!c.simple) return false;
    int64_t total = 0;
    for (int64_t id : ids) {
      if (id < 0 || static_cast<size_t>(id) >= g_ticks.size() || g_ticks[static_cast<size_t>(id)] < 0) return false;
      total += g_ticks[static_cast<size_t>(id)];
    }
    bool pop;
    const int64_t h = dispatch_to(c, &pop);
    const int64_t t0 = c.ready0 > h ? c.ready0 : h;
    int64_t wait = h - (c.ready0 > c.busy ? c.ready0 : c.busy);
    if (wait < 0) wait = 0;
    if (total > 0 && c.last_open > t0) return false;  // its first kernel overlaps an open interval (Python's merge)
    if (c.others > t0) return false;  // beside another stream's kernel (Device._book's sharing)
    if (pop) c.inflight.erase(c.inflight.begin());
    st.host = h;
    use(c, core);
    int64_t t = t0, w = wait;
    for (int64_t id : ids) {
      const int64_t ticks = g_ticks[static_cast<size_t>(id)];
      const int64_t end = t + ticks;
      if (ticks) book(c, t, end, id);
      row(id, ticks, w);
      w = 0;  // kernels of one graph follow each other without the host
      t = end;
    }
    c.launches += static_cast<int64_t>(ids.size());
    c.wait += wait;
    c.dispatches += 1;
    c.graphs += 1;
    if (t > c.max_end) c.max_end = t;
    if (total > 0) {  // its kernels' intervals, back to back: one interval of the union (CoreTally's busy)
      c.ticks += total;
      c.last_host = h;
      c.fresh.emplace_back(t0, t);
      c.last_open = t;
    }
    c.ready0 = t;
    if (t > c.busy) c.busy = t;
    if (t > t0) c.inflight.push_back(t);
    return true;
  };
  std::lock_guard<std::mutex> lock(g_log_mutex);
  std::lock_guard<std::mutex> tlock(g_ticks_mutex);
  const int64_t n = static_cast<int64_t>(g_log.size() / 3);
  std::unordered_set<int64_t> closed;  // captures whose close is in the log
  if (g_log_closes > 0) {
    for (int64_t j = 0; j < n; ++j) {
      if (g_log[3 * j] == -2) closed.insert(g_log[3 * j + 1]);
    }
  }
  std::unordered_map<int64_t, std::vector<std::pair<int64_t, int64_t>>> open;  // token -> its (core, handle)s so far
  State ckpt;
  int64_t ckpt_i = -1;
  int64_t i = 0;
  for (; i < n; ++i) {
    const int64_t kind = g_log[3 * i], core = g_log[3 * i + 1], id = g_log[3 * i + 2];
    if (kind == 1) {  // a host op: counted by name
      if (core != 0 && g_learning.count(core) != 0) break;  // made inside Device.recorded: Python's loop learns it
      st.hop.add(id);
      continue;
    }
    if (kind == -1) {  // the host waits for the core's work (Device.synchronize): no dispatch of its own
      if (core < 0 || core >= ncores || !st.cs[static_cast<size_t>(core)].simple) break;
      const Core& c = st.cs[static_cast<size_t>(core)];
      const int64_t ready = c.ready0 > c.ready_other ? c.ready0 : c.ready_other;  // every stream's work
      if (ready > st.host) {
        st.waited += ready - st.host;
        st.host = ready;
      }
      continue;
    }
    if (kind >= 2) {  // made inside capture kind - 2: placed at its close, if that is in the log
      if (closed.count(kind - 2) == 0) break;  // still open: Python collects it
      if (open.empty()) {
        ckpt = st;
        ckpt_i = i;
      }
      open[kind - 2].emplace_back(core, id);
      continue;
    }
    if (kind == -2) {  // capture `core` closed: its launches issued here, one dispatch per run on a core
      auto it = open.find(core);
      if (it == open.end() || id == 0) {  // it launched nothing (a closed capture's launches are all in the
        if (it != open.end()) open.erase(it);  // log), or it was muted: its launches dropped
        ++st.closes;
        continue;
      }
      const auto& got = it->second;
      bool ok = true;
      for (size_t a = 0; ok && a < got.size();) {
        size_t b = a + 1;
        while (b < got.size() && got[b].first == got[a].first) ++b;
        if (b - a == 1) {
          ok = launch(got[a].first, got[a].second);
        } else {
          std::vector<int64_t> ids;
          for (size_t k = a; k < b; ++k) ids.push_back(got[k].second);
          ok = graph_run(got[a].first, ids);
        }
        a = b;
      }
      if (!ok) break;
      open.erase(it);
      ++st.closes;
      continue;
    }
    if (kind != 0 || !launch(core, id)) break;
  }
  if (!open.empty()) {  // a capture's launches without its close: back to where the first of them stood
    st = std::move(ckpt);
    i = ckpt_i;
  }
  if (i == 0) return 0;
  // per core: the fresh intervals a recorder folds (ended by the host of its last add) and the ones it keeps open
  for (size_t k = 0; k < st.order.size(); ++k) {
    Core& c = st.cs[static_cast<size_t>(st.order[k])];
    int64_t* o = cores_out + k * kPlaceOut;
    o[0] = st.order[k];
    o[1] = c.launches;
    o[2] = c.wait;
    o[3] = c.ticks;
    o[4] = c.max_end;
    o[5] = c.last_host;
    int64_t folded = 0, kept = 0;
    for (const auto& iv : c.fresh) {
      if (iv.second <= c.last_host) {
        folded += iv.second - iv.first;
      } else {
        if (kept == kSurvivors) return -1;
        o[8 + 2 * kept] = iv.first;
        o[9 + 2 * kept] = iv.second;
        ++kept;
      }
    }
    o[6] = folded;
    o[7] = kept;
    const int64_t nb = static_cast<int64_t>(c.bookings.size() / 3);
    const int64_t from = nb > kBookings ? nb - kBookings : 0;
    o[32] = nb - from;
    std::memcpy(o + 33, c.bookings.data() + 3 * from, static_cast<size_t>(3 * (nb - from)) * sizeof(int64_t));
    o[60] = c.dispatches;
    o[61] = c.graphs;
    int64_t* back = io + 8 + st.order[k] * kPlaceIn;
    back[2] = c.ready0;
    back[3] = c.busy;
    back[4] = static_cast<int64_t>(c.inflight.size());
    if (back[4] > kInflight) return -1;
    std::memcpy(back + 5, c.inflight.data(), c.inflight.size() * sizeof(int64_t));
  }
  io[0] = st.host;
  io[6] = st.waited;
  io[7] = st.closes;
  *ncores_out = static_cast<int64_t>(st.order.size());
  *nrows = static_cast<int64_t>(st.row_v.size() / 4);
  std::memcpy(rows, st.row_v.data(), st.row_v.size() * sizeof(int64_t));
  *nhops = st.hop.write(hops);
  erase_log_locked(i);
  return i;
}
const char* trnsim_fast_name(int64_t id) {
  std::lock_guard<std::mutex> lock(g_fast_mutex);
  return id >= 0 && id < static_cast<int64_t>(g_names.size()) ? g_names[id].c_str() : "";
}
// Python's path is costing op `name` ("ns::op.overload") for the fast path: teach it `handle`
int trnsim_fast_learning(const char* name) {
  Learn* l = t_learn;
  if (l == nullptr || l->handle >= 0) return 0;
  const auto& on = l->op->operator_name();
  std::string full = on.overload_name.empty() ? on.name : on.name + "." + on.overload_name;
  return full == name ? 1 : 0;
}
void trnsim_fast_learn(int64_t handle) {
  if (t_learn != nullptr) t_learn->handle = handle;
}
void trnsim_fast_learn_many(const int64_t* handles, int64_t count) {
  if (t_learn == nullptr || count < 1) return;
  t_learn->many.assign(handles, handles + count);
  t_learn->handle = handles[0];
}
void trnsim_mem_set_pool(int64_t** rows, int count) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  g_pool.assign(rows, rows + count);
}
int trnsim_mem_reserve(int64_t* st, int64_t nbytes) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  if (st[0] + nbytes > st[kCapacity]) {
    st[kOoms] += 1;
    return 0;
  }
  mem_add_locked(st, nbytes);
  return 1;
}
void trnsim_mem_sub(int64_t* st, int64_t nbytes, int undo) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  mem_sub_locked(st, nbytes, undo != 0);
}
// live fast blocks as (device, bytes, address) triples into `out` (up to cap); returns how many live
int64_t trnsim_fast_blocks(int64_t* out, int64_t cap) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  int64_t n = 0;
  for (FastBlock* b = g_blocks; b != nullptr; b = b->next, ++n) {
    if (n < cap) {
      out[3 * n] = b->index;
      out[3 * n + 1] = b->nbytes;
      out[3 * n + 2] = reinterpret_cast<int64_t>(b->cpu.storage().data());
    }
  }
  return n;
}
// frees of fast blocks recorded while memory history was on: (device, addr, bytes, time_us) each
int64_t trnsim_fast_freed(int64_t* out, int64_t cap) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  int64_t n = std::min<int64_t>(static_cast<int64_t>(g_freed.size()), cap);
  for (int64_t i = 0; i < n; ++i) {
    out[4 * i] = g_freed[i].index;
    out[4 * i + 1] = g_freed[i].addr;
    out[4 * i + 2] = g_freed[i].nbytes;
    out[4 * i + 3] = g_freed[i].time_us;
  }
  g_freed.erase(g_freed.begin(), g_freed.begin() + n);
  return n;
}
}  // extern "C"
