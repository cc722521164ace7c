/* The kernel builder's dependency tracker (trnsim.kernel.DependencyTracker) in C.
 *
 * The same algorithm as the Python class, access for access: histories of pending reads and
 * writes per buffer, boxes compared for overlap and cover, covered accesses pruned, freed
 * on-chip regions kept in a graveyard indexed by 2 KiB address chunks. Only the data layout
 * differs (flat arrays instead of lists of tuples). Read by build.py for cffi's cdef:
 * declarations only below the include guard.
 */
#ifndef TRNSIM_DEPTRACK_H
#define TRNSIM_DEPTRACK_H
#include <stdint.h>

typedef struct dt_tracker dt_tracker;

dt_tracker *dt_new(void);
void dt_free(dt_tracker *t);
/* A new history: tile=1 for an SBUF/PSUM allocation (filled from the graveyard of `space`,
 * 0 = sbuf, 1 = psum, over partitions [p0, p1) and bytes [a0, a1)), tile=0 for an HBM tensor.
 * Returns its id, or -1 when out of memory. */
int32_t dt_history(dt_tracker *t, int32_t tile, int32_t space, int64_t p0, int64_t p1, int64_t a0, int64_t a1);
/* History `hid` of an allocation is freed: its pending accesses go to the graveyard. 0 or -1. */
int32_t dt_freed(dt_tracker *t, int32_t hid, int32_t space, int64_t p0, int64_t p1, int64_t a0, int64_t a1);
/* A region of history `hid`: `n` box coordinates (lo0, hi0, lo1, hi1, ...). Returns a handle. */
int32_t dt_region(dt_tracker *t, int32_t hid, const int64_t *box, int32_t n);
int32_t dt_region4(dt_tracker *t, int32_t hid, int64_t b0, int64_t b1, int64_t b2, int64_t b3);
/* Record instruction `idx` (queue/engine key `key`, `dma` when it is a DMA) reading regions
 * reads[0..nr) and writing writes[0..nw). Results in dt_out: [nfirst, ndeps, first...,
 * deps...]: with first >= 0, reads[first]'s read-after-write edges before this instruction
 * (nfirst of them; else nfirst = -1 and none), then the instruction's own edges (sorted,
 * unique). Returns how many ints that is, or -1 when out of memory. */
int32_t dt_record(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, const int32_t *reads, int32_t nr,
                  const int32_t *writes, int32_t nw, int32_t first);
int32_t dt_record6(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, int32_t nr, int32_t r0, int32_t r1,
                   int32_t r2, int32_t r3, int32_t r4, int32_t r5, int32_t nw, int32_t w0, int32_t w1,
                   int32_t first);
/* dt_record of an instruction with one read and one write and no `first` (a DMA, a copy). */
int32_t dt_record11(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, int32_t r, int32_t w);
/* dt_record (no `first`) of an instruction with 2 reads / 1 write, 3 reads / 1 write, 2 reads /
 * 2 writes: the generic engine instructions (tensor_tensor, tensor_scalar with a tile operand,
 * activation with a bias or a fused reduction), with fewer arguments to convert. */
int32_t dt_record21(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, int32_t r0, int32_t r1, int32_t w);
int32_t dt_record31(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, int32_t r0, int32_t r1, int32_t r2,
                    int32_t w);
int32_t dt_record22(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, int32_t r0, int32_t r1, int32_t w0,
                    int32_t w1);
/* dt_record of a PE transpose: reads r (its `first`), writes w. */
int32_t dt_record_first11(dt_tracker *t, int32_t idx, int32_t key, int32_t r, int32_t w);
/* n PE transposes idx0, idx0+1, ...: each reads data[i] (its `first`) and writes dst[i]; their
 * results one after the other in dt_out, each laid out as dt_record's. Returns how many ints. */
int32_t dt_record_transposes(dt_tracker *t, int32_t idx0, int32_t key, int32_t n, const int32_t *data,
                             const int32_t *dst);
/* n matmuls idx0, idx0+1, ...: each reads st[i], mv[i] (and dst[i] when acc[i]) and writes
 * dst[i], its first operand st[i]; their results one after the other in dt_out, each laid
 * out as dt_record's. Returns how many ints in all, or -1. */
int32_t dt_record_matmuls(dt_tracker *t, int32_t idx0, int32_t key, int32_t n, const int32_t *st, const int32_t *mv,
                          const int32_t *dst, const int32_t *acc);
/* n instructions idx0, idx0+1, ... in one call: spec holds, per instruction, [key, dma, first,
 * nr, reads..., nw, writes...] (dt_record's arguments). Results in dt_out: 2n+1 offsets, then
 * the values; instruction i's first-operand edges are values[off[2i]:off[2i+1]] (none without
 * `first`), its own edges values[off[2i+1]:off[2i+2]]. Returns how many ints in all, or -1. */
int32_t dt_record_many(dt_tracker *t, int32_t idx0, int32_t n, const int32_t *spec, int32_t nspec);
/* The read-after-write edges of a read of `region`, into out[..]; returns how many. */
int32_t dt_raw_deps(dt_tracker *t, int32_t region);
/* The edge log: each dt_record* call's results, in call order. dt_log_size checks that the
 * records are instructions 0, 1, 2... each once, in order, and sets sizes = {records, deps,
 * first deps}: 0, or -1 when they are not (or the log ran out of memory). dt_log_columns then
 * writes them as the simulator's columns (offsets have records + 1 entries; has_first 0 where
 * the record had no first operand). */
int32_t dt_log_size(dt_tracker *t, int64_t *sizes);
/* The last record had no first operand among its reads: its first deps are out[0..n) (what
 * dt_raw_deps just left there). 0, or -1 when the last record already has first deps. */
int32_t dt_log_first(dt_tracker *t, int32_t n);
int32_t dt_log_columns(dt_tracker *t, int64_t *dep_off, int32_t *deps, int8_t *has_first, int64_t *first_off,
                       int32_t *first);
/* The whole state as int64s into buf[0..cap) (pickling); returns how many it takes (call with
 * buf NULL to size it). dt_load fills a fresh tracker from them: 0, or -1 if they are not a dump. */
int64_t dt_dump(dt_tracker *t, int64_t *buf, int64_t cap);
int32_t dt_load(dt_tracker *t, const int64_t *buf, int64_t n);
/* The output buffer of dt_record / dt_raw_deps; it moves only when *dt_outgen(t) changes. */
int32_t *dt_out(dt_tracker *t);
const int32_t *dt_outgen(dt_tracker *t);
#endif
