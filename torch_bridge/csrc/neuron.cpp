// The parts of the `neuron` device that PyTorch only lets C++ provide (torch 2.13): the
// PrivateUse1 hooks (pinned host memory, storage resize, generators) and a stateful device
// guard. Built once per torch version by torch_bridge/_native.py and loaded with ctypes; every
// entry point Python calls is `extern "C"` below. Nothing here calls Python except the storage
// allocator callbacks (resize), which Python registers; the guard's methods never do, so they
// are safe inside autograd's worker threads and while an exception unwinds.

#include <ATen/EmptyTensor.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
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

TORCH_LIBRARY(trnsim, m) { m.def("default_generator(int index) -> Generator?", &default_generator_op); }

}  // namespace trnsim_neuron

using namespace trnsim_neuron;

extern "C" {

// Register the hooks (once per process; PyTorch accepts one registration). Returns 0 on
// success, 1 if some other PrivateUse1 hooks were registered first.
int trnsim_register_hooks() {
  if (at::isPrivateUse1HooksRegistered()) return 1;
  static Hooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
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

}  // extern "C"
