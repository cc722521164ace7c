/* The kernel builder's dependency tracker in C: trnsim.kernel.DependencyTracker's algorithm,
 * step for step (see deptrack.h and the Python class, which stays the reference). */
#include "deptrack.h"

#include <stdlib.h>
#include <string.h>

#define GRAVE_CHUNK 2048      /* bytes per graveyard bucket (kernel.py _GRAVE_CHUNK) */
#define READ_PRUNE_WINDOW 8   /* kernel.py _READ_PRUNE_WINDOW */

typedef struct {
    int64_t serial;  /* which access this is: copies inherited from a grave keep it (dedup) */
    int32_t boff;    /* box: coordinates pool[boff .. boff + blen) */
    int32_t blen;
    int32_t idx;     /* instruction index */
    int32_t key;     /* engine / queue key */
} acc_t;

typedef struct {
    acc_t *v;
    int32_t n, cap;
} accvec;

typedef struct {
    accvec writes, reads;
    int32_t tile;
} hist_t;

typedef struct {
    int64_t box[4];
    int32_t hid;
    int32_t alive;
    int64_t seen;  /* epoch of the last allocation that looked at it */
} grave_t;

typedef struct {
    int32_t *v;
    int32_t n, cap;
} ivec;

typedef struct {
    int32_t hid, boff, blen;
} region_t;

typedef struct {
    int64_t serial;
    int32_t pos;
} spos_t;

struct dt_tracker {
    int64_t *pool;
    int64_t npool, cappool;
    region_t *regions;
    int32_t nregions, capregions;
    hist_t *hists;
    int32_t nhists, caphists;
    grave_t *graves;
    int32_t ngraves, capgraves;
    ivec *buckets[2];
    int32_t nbuckets[2];
    int64_t serial, epoch;
    int32_t *out;
    int32_t capout;
    int32_t outgen; /* bumped whenever `out` moves (the caller caches the pointer) */
    int32_t *tmp;
    int32_t ntmp, captmp;
    /* the edge log: every record's (idx, nfirst, ndeps) in logh, its first... deps... in logv
     * (what the simulator reads instead of each instruction's tuples, dt_log_*) */
    int32_t *logh, *logv;
    int32_t nlogh, caplogh, nlogv, caplogv;
    int32_t log_bad; /* 1 once the log ran out of memory: it is then incomplete */
};

static int grow(void **p, int32_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return 0;
    int64_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    if (c > 0x7fffffff) return -1;
    void *q = realloc(*p, (size_t)c * elem);
    if (!q) return -1;
    *p = q;
    *cap = (int32_t)c;
    return 0;
}

static int acc_push(accvec *a, acc_t x) {
    if (grow((void **)&a->v, &a->cap, (int64_t)a->n + 1, sizeof(acc_t))) return -1;
    a->v[a->n++] = x;
    return 0;
}

static int acc_extend(accvec *a, const accvec *b) {
    if (!b->n) return 0;
    if (grow((void **)&a->v, &a->cap, (int64_t)a->n + b->n, sizeof(acc_t))) return -1;
    memcpy(a->v + a->n, b->v, (size_t)b->n * sizeof(acc_t));
    a->n += b->n;
    return 0;
}

static int tmp_push(dt_tracker *t, int32_t x) {
    if (grow((void **)&t->tmp, &t->captmp, (int64_t)t->ntmp + 1, sizeof(int32_t))) return -1;
    t->tmp[t->ntmp++] = x;
    return 0;
}

static inline int overlap(const int64_t *a, int32_t na, const int64_t *b, int32_t nb) {
    if (na != nb) /* an exact box vs a flat span of the same tensor: compare the flat spans */
        return a[na - 2] < b[nb - 1] && b[nb - 2] < a[na - 1];
    for (int32_t i = 0; i < na; i += 2)
        if (a[i] >= b[i + 1] || b[i] >= a[i + 1]) return 0;
    return 1;
}

static inline int covers(const int64_t *outer, int32_t no, const int64_t *inner, int32_t ni) {
    if (no != ni) return 0;
    for (int32_t i = 0; i < no; i += 2)
        if (inner[i] < outer[i] || inner[i + 1] > outer[i + 1]) return 0;
    return 1;
}

dt_tracker *dt_new(void) { return (dt_tracker *)calloc(1, sizeof(dt_tracker)); }

static void hist_clear(hist_t *h) {
    free(h->writes.v);
    free(h->reads.v);
    memset(&h->writes, 0, sizeof(accvec));
    memset(&h->reads, 0, sizeof(accvec));
}

void dt_free(dt_tracker *t) {
    if (!t) return;
    for (int32_t i = 0; i < t->nhists; i++) hist_clear(&t->hists[i]);
    for (int s = 0; s < 2; s++) {
        for (int32_t c = 0; c < t->nbuckets[s]; c++) free(t->buckets[s][c].v);
        free(t->buckets[s]);
    }
    free(t->pool);
    free(t->regions);
    free(t->hists);
    free(t->graves);
    free(t->out);
    free(t->tmp);
    free(t->logh);
    free(t->logv);
    free(t);
}

static int cmp_spos(const void *x, const void *y) {
    const spos_t *a = (const spos_t *)x, *b = (const spos_t *)y;
    if (a->serial != b->serial) return a->serial < b->serial ? -1 : 1;
    return a->pos < b->pos ? -1 : (a->pos > b->pos);
}

/* Keep the first copy of each access (Python: list({id(a): a for a in accs}.values())). */
static int dedup(accvec *a) {
    if (a->n < 2) return 0;
    spos_t *s = (spos_t *)malloc((size_t)a->n * sizeof(spos_t));
    char *drop = (char *)calloc((size_t)a->n, 1);
    if (!s || !drop) {
        free(s);
        free(drop);
        return -1;
    }
    for (int32_t i = 0; i < a->n; i++) {
        s[i].serial = a->v[i].serial;
        s[i].pos = i;
    }
    qsort(s, (size_t)a->n, sizeof(spos_t), cmp_spos);
    for (int32_t i = 1; i < a->n; i++)
        if (s[i].serial == s[i - 1].serial) drop[s[i].pos] = 1;
    int32_t k = 0;
    for (int32_t i = 0; i < a->n; i++)
        if (!drop[i]) a->v[k++] = a->v[i];
    a->n = k;
    free(s);
    free(drop);
    return 0;
}

int32_t dt_history(dt_tracker *t, int32_t tile, int32_t space, int64_t p0, int64_t p1, int64_t a0, int64_t a1) {
    if (grow((void **)&t->hists, &t->caphists, (int64_t)t->nhists + 1, sizeof(hist_t))) return -1;
    int32_t hid = t->nhists++;
    hist_t *h = &t->hists[hid];
    memset(h, 0, sizeof(hist_t));
    h->tile = tile;
    if (!tile) return hid;
    if (space < 0 || space > 1) return -1;
    int64_t box[4] = {p0, p1, a0, a1};
    int64_t epoch = ++t->epoch;
    int32_t nseen = 0;
    for (int64_t c = a0 / GRAVE_CHUNK; c <= (a1 - 1) / GRAVE_CHUNK; c++) {
        if (c >= t->nbuckets[space]) break;
        ivec *b = &t->buckets[space][c];
        if (!b->n) continue;
        for (int32_t i = 0; i < b->n; i++) {
            grave_t *g = &t->graves[b->v[i]];
            if (!g->alive || g->seen == epoch) continue;
            g->seen = epoch;
            nseen++;
            if (overlap(box, 4, g->box, 4)) {
                hist_t *gh = &t->hists[g->hid];
                h = &t->hists[hid];
                if (acc_extend(&h->writes, &gh->writes) || acc_extend(&h->reads, &gh->reads)) return -1;
                if (covers(box, 4, g->box, 4)) {
                    g->alive = 0; /* the new tile's history now carries it */
                    hist_clear(gh);
                }
            }
        }
        int32_t k = 0;
        for (int32_t i = 0; i < b->n; i++)
            if (t->graves[b->v[i]].alive) b->v[k++] = b->v[i];
        b->n = k;
    }
    h = &t->hists[hid];
    if (nseen > 1 && (dedup(&h->writes) || dedup(&h->reads))) return -1;
    return hid;
}

int32_t dt_freed(dt_tracker *t, int32_t hid, int32_t space, int64_t p0, int64_t p1, int64_t a0, int64_t a1) {
    if (hid < 0 || hid >= t->nhists || space < 0 || space > 1) return -1;
    hist_t *h = &t->hists[hid];
    if (!h->writes.n && !h->reads.n) {
        hist_clear(h);
        return 0;
    }
    if (grow((void **)&t->graves, &t->capgraves, (int64_t)t->ngraves + 1, sizeof(grave_t))) return -1;
    int32_t gid = t->ngraves++;
    grave_t *g = &t->graves[gid];
    g->box[0] = p0;
    g->box[1] = p1;
    g->box[2] = a0;
    g->box[3] = a1;
    g->hid = hid;
    g->alive = 1;
    g->seen = 0;
    int64_t last = (a1 - 1) / GRAVE_CHUNK;
    if (last >= t->nbuckets[space]) {
        int64_t n = last + 1;
        ivec *nb = (ivec *)realloc(t->buckets[space], (size_t)n * sizeof(ivec));
        if (!nb) return -1;
        memset(nb + t->nbuckets[space], 0, (size_t)(n - t->nbuckets[space]) * sizeof(ivec));
        t->buckets[space] = nb;
        t->nbuckets[space] = (int32_t)n;
    }
    for (int64_t c = a0 / GRAVE_CHUNK; c <= last; c++) {
        ivec *b = &t->buckets[space][c];
        if (grow((void **)&b->v, &b->cap, (int64_t)b->n + 1, sizeof(int32_t))) return -1;
        b->v[b->n++] = gid;
    }
    return 0;
}

int32_t dt_region(dt_tracker *t, int32_t hid, const int64_t *box, int32_t n) {
    if (hid < 0 || hid >= t->nhists || n < 2 || n % 2) return -1;
    if (t->npool + n > 0x7fffffff) return -1;
    int32_t cap = (int32_t)t->cappool;
    if (grow((void **)&t->pool, &cap, t->npool + n, sizeof(int64_t))) return -1;
    t->cappool = cap;
    if (grow((void **)&t->regions, &t->capregions, (int64_t)t->nregions + 1, sizeof(region_t))) return -1;
    memcpy(t->pool + t->npool, box, (size_t)n * sizeof(int64_t));
    region_t *r = &t->regions[t->nregions];
    r->hid = hid;
    r->boff = (int32_t)t->npool;
    r->blen = n;
    t->npool += n;
    return t->nregions++;
}

int32_t dt_region4(dt_tracker *t, int32_t hid, int64_t b0, int64_t b1, int64_t b2, int64_t b3) {
    int64_t box[4] = {b0, b1, b2, b3};
    return dt_region(t, hid, box, 4);
}

static int cmp_i32(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return a < b ? -1 : (a > b);
}

/* tmp[from..ntmp) sorted and unique, without `skip`, appended to out at `at`; returns count. */
static int out_grow(dt_tracker *t, int64_t need) {
    int32_t *old = t->out;
    if (grow((void **)&t->out, &t->capout, need, sizeof(int32_t))) return -1;
    if (t->out != old) t->outgen++;
    return 0;
}

static int32_t emit_sorted(dt_tracker *t, int32_t from, int32_t at, int32_t skip) {
    int32_t n = t->ntmp - from;
    int32_t *v = t->tmp + from;
    if (n > 1) qsort(v, (size_t)n, sizeof(int32_t), cmp_i32);
    if (out_grow(t, (int64_t)at + n + 1)) return -1;
    int32_t k = 0;
    for (int32_t i = 0; i < n; i++) {
        if (v[i] == skip || (i && v[i] == v[i - 1])) continue;
        t->out[at + k++] = v[i];
    }
    return k;
}

int32_t dt_raw_deps(dt_tracker *t, int32_t region) {
    if (region < 0 || region >= t->nregions) return -1;
    region_t r = t->regions[region];
    const int64_t *box = t->pool + r.boff;
    hist_t *h = &t->hists[r.hid];
    t->ntmp = 0;
    for (int32_t i = 0; i < h->writes.n; i++) {
        acc_t *w = &h->writes.v[i];
        if (overlap(t->pool + w->boff, w->blen, box, r.blen) && tmp_push(t, w->idx)) return -1;
    }
    return emit_sorted(t, 0, 0, INT32_MIN);
}

int32_t *dt_out(dt_tracker *t) {
    if (out_grow(t, 256)) return NULL;
    return t->out;
}

const int32_t *dt_outgen(dt_tracker *t) { return &t->outgen; }

/* Append the record whose results are at out[at..] to the edge log (a log that cannot grow is
 * marked bad, not an error: the simulator then reads the instructions' own tuples). */
static void log_record(dt_tracker *t, int32_t idx, int32_t at) {
    int32_t nfirst = t->out[at], nd = t->out[at + 1];
    int32_t nv = (nfirst > 0 ? nfirst : 0) + nd;
    if (t->log_bad) return;
    if (grow((void **)&t->logh, &t->caplogh, (int64_t)t->nlogh + 3, sizeof(int32_t)) ||
        grow((void **)&t->logv, &t->caplogv, (int64_t)t->nlogv + nv, sizeof(int32_t))) {
        t->log_bad = 1;
        return;
    }
    t->logh[t->nlogh++] = idx;
    t->logh[t->nlogh++] = nfirst;
    t->logh[t->nlogh++] = nd;
    memcpy(t->logv + t->nlogv, t->out + at + 2, (size_t)nv * sizeof(int32_t));
    t->nlogv += nv;
}

int32_t dt_log_first(dt_tracker *t, int32_t n) {
    if (t->log_bad) return 0;
    if (t->nlogh < 3 || t->logh[t->nlogh - 2] >= 0 || n < 0) return -1;
    if (grow((void **)&t->logv, &t->caplogv, (int64_t)t->nlogv + n, sizeof(int32_t))) {
        t->log_bad = 1;
        return 0;
    }
    int32_t nd = t->logh[t->nlogh - 1];
    int32_t *v = t->logv + t->nlogv - nd;
    memmove(v + n, v, (size_t)nd * sizeof(int32_t));
    memcpy(v, t->out, (size_t)n * sizeof(int32_t));
    t->nlogv += n;
    t->logh[t->nlogh - 2] = n;
    return 0;
}

int32_t dt_log_size(dt_tracker *t, int64_t *sizes) {
    if (t->log_bad) return -1;
    int64_t nd = 0, nf = 0, n = t->nlogh / 3;
    for (int64_t i = 0; i < n; i++) {
        const int32_t *h = t->logh + 3 * i;
        if (h[0] != i) return -1;
        if (h[1] > 0) nf += h[1];
        nd += h[2];
    }
    sizes[0] = n;
    sizes[1] = nd;
    sizes[2] = nf;
    return 0;
}

int32_t dt_log_columns(dt_tracker *t, int64_t *dep_off, int32_t *deps, int8_t *has_first, int64_t *first_off,
                       int32_t *first) {
    int64_t n = t->nlogh / 3, pd = 0, pf = 0, pv = 0;
    dep_off[0] = first_off[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const int32_t *h = t->logh + 3 * i;
        int32_t nfirst = h[1], nd = h[2];
        has_first[i] = nfirst >= 0;
        if (nfirst > 0) {
            memcpy(first + pf, t->logv + pv, (size_t)nfirst * sizeof(int32_t));
            pf += nfirst;
            pv += nfirst;
        }
        memcpy(deps + pd, t->logv + pv, (size_t)nd * sizeof(int32_t));
        pd += nd;
        pv += nd;
        dep_off[i + 1] = pd;
        first_off[i + 1] = pf;
    }
    return 0;
}

/* One instruction's record; its results go to out[at..]: [nfirst, ndeps, first..., deps...]
 * (nfirst -1 without `first`). Returns the number written, or -1. */
static int32_t record_at(dt_tracker *t, int32_t at, int32_t idx, int32_t key, int32_t dma, const int32_t *reads,
                         int32_t nr, const int32_t *writes, int32_t nw, int32_t first) {
    const int64_t *pool = t->pool;
    int32_t nfirst = -1;
    if (out_grow(t, (int64_t)at + 256)) return -1;
    t->ntmp = 0;
    for (int32_t i = 0; i < nr; i++) {
        if (reads[i] < 0 || reads[i] >= t->nregions) return -1;
        region_t r = t->regions[reads[i]];
        const int64_t *box = pool + r.boff;
        hist_t *h = &t->hists[r.hid];
        if (i == first) { /* the stationary operand's own read-after-write edges */
            int32_t from = t->ntmp;
            for (int32_t j = 0; j < h->writes.n; j++) {
                acc_t *w = &h->writes.v[j];
                if (overlap(pool + w->boff, w->blen, box, r.blen) && tmp_push(t, w->idx)) return -1;
            }
            nfirst = emit_sorted(t, from, at + 2, INT32_MIN);
            if (nfirst < 0) return -1;
            t->ntmp = from;
        }
        for (int32_t j = 0; j < h->writes.n; j++) {
            acc_t *w = &h->writes.v[j];
            if (overlap(pool + w->boff, w->blen, box, r.blen) && tmp_push(t, w->idx)) return -1;
        }
    }
    for (int32_t i = 0; i < nw; i++) {
        if (writes[i] < 0 || writes[i] >= t->nregions) return -1;
        region_t r = t->regions[writes[i]];
        const int64_t *box = pool + r.boff;
        hist_t *h = &t->hists[r.hid];
        /* an overlapping write is an edge; a write this one covers is pruned */
        int32_t k = 0;
        for (int32_t j = 0; j < h->writes.n; j++) {
            acc_t w = h->writes.v[j];
            const int64_t *o = pool + w.boff;
            if (overlap(o, w.blen, box, r.blen) && tmp_push(t, w.idx)) return -1;
            if (!covers(box, r.blen, o, w.blen)) h->writes.v[k++] = w;
        }
        h->writes.n = k;
        acc_t nwacc = {++t->serial, r.boff, r.blen, idx, key};
        if (acc_push(&h->writes, nwacc)) return -1;
        /* a compute engine's own earlier reads are done before it issues this write (in
         * order); a DMA queue only orders completions, so its reads still need an edge */
        k = 0;
        for (int32_t j = 0; j < h->reads.n; j++) {
            acc_t rd = h->reads.v[j];
            const int64_t *o = pool + rd.boff;
            if ((rd.key != key || dma) && overlap(o, rd.blen, box, r.blen) && tmp_push(t, rd.idx)) return -1;
            if (!covers(box, r.blen, o, rd.blen)) h->reads.v[k++] = rd;
        }
        h->reads.n = k;
    }
    for (int32_t i = 0; i < nr; i++) {
        region_t r = t->regions[reads[i]];
        const int64_t *box = pool + r.boff;
        accvec *rv = &t->hists[r.hid].reads;
        int32_t n = rv->n;
        int32_t stop = n - 1 - READ_PRUNE_WINDOW;
        if (stop < -1) stop = -1;
        for (int32_t j = n - 1; j > stop; j--) {
            acc_t *o = &rv->v[j];
            if (o->key == key && covers(box, r.blen, pool + o->boff, o->blen)) {
                memmove(rv->v + j, rv->v + j + 1, (size_t)(rv->n - j - 1) * sizeof(acc_t));
                rv->n--;
            }
        }
        acc_t nracc = {++t->serial, r.boff, r.blen, idx, key};
        if (acc_push(rv, nracc)) return -1;
    }
    int32_t nf = nfirst > 0 ? nfirst : 0;
    int32_t nd = emit_sorted(t, 0, at + 2 + nf, idx);
    if (nd < 0) return -1;
    t->out[at] = nfirst;
    t->out[at + 1] = nd;
    log_record(t, idx, at);
    return 2 + nf + nd;
}

int32_t dt_record(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, const int32_t *reads, int32_t nr,
                  const int32_t *writes, int32_t nw, int32_t first) {
    return record_at(t, 0, idx, key, dma, reads, nr, writes, nw, first);
}

int32_t dt_record_matmuls(dt_tracker *t, int32_t idx0, int32_t key, int32_t n, const int32_t *st, const int32_t *mv,
                          const int32_t *dst, const int32_t *acc) {
    int32_t at = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t reads[3] = {st[i], mv[i], dst[i]};
        int32_t w = dst[i];
        int32_t k = record_at(t, at, idx0 + i, key, 0, reads, acc[i] ? 3 : 2, &w, 1, 0);
        if (k < 0) return -1;
        at += k;
    }
    return at;
}

int32_t dt_record6(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, int32_t nr, int32_t r0, int32_t r1,
                   int32_t r2, int32_t r3, int32_t r4, int32_t r5, int32_t nw, int32_t w0, int32_t w1,
                   int32_t first) {
    int32_t reads[6] = {r0, r1, r2, r3, r4, r5};
    int32_t writes[2] = {w0, w1};
    if (nr < 0 || nr > 6 || nw < 0 || nw > 2) return -1;
    return dt_record(t, idx, key, dma, reads, nr, writes, nw, first);
}

int32_t dt_record11(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, int32_t r, int32_t w) {
    return record_at(t, 0, idx, key, dma, &r, 1, &w, 1, -1);
}

int32_t dt_record21(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, int32_t r0, int32_t r1, int32_t w) {
    int32_t reads[2] = {r0, r1};
    return record_at(t, 0, idx, key, dma, reads, 2, &w, 1, -1);
}

int32_t dt_record31(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, int32_t r0, int32_t r1, int32_t r2,
                    int32_t w) {
    int32_t reads[3] = {r0, r1, r2};
    return record_at(t, 0, idx, key, dma, reads, 3, &w, 1, -1);
}

int32_t dt_record22(dt_tracker *t, int32_t idx, int32_t key, int32_t dma, int32_t r0, int32_t r1, int32_t w0,
                    int32_t w1) {
    int32_t reads[2] = {r0, r1};
    int32_t writes[2] = {w0, w1};
    return record_at(t, 0, idx, key, dma, reads, 2, writes, 2, -1);
}

int32_t dt_record_first11(dt_tracker *t, int32_t idx, int32_t key, int32_t r, int32_t w) {
    return record_at(t, 0, idx, key, 0, &r, 1, &w, 1, 0);
}

int32_t dt_record_transposes(dt_tracker *t, int32_t idx0, int32_t key, int32_t n, const int32_t *data,
                             const int32_t *dst) {
    int32_t at = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t k = record_at(t, at, idx0 + i, key, 0, &data[i], 1, &dst[i], 1, 0);
        if (k < 0) return -1;
        at += k;
    }
    return at;
}

/* n instructions idx0, idx0+1, ... recorded one after the other, as n dt_record calls would:
 * spec holds, per instruction, [key, dma, first, nr, reads..., nw, writes...]. Results in
 * dt_out as 2n+1 offsets then the values: instruction i's first-operand edges are
 * values[off[2i]:off[2i+1]] (none without `first`) and its own edges values[off[2i+1]:off[2i+2]].
 * Returns how many ints in all, or -1 (out of memory, or a spec that does not parse). */
int32_t dt_record_many(dt_tracker *t, int32_t idx0, int32_t n, const int32_t *spec, int32_t nspec) {
    int32_t at = 0, p = 0;
    if (n < 0) return -1;
    for (int32_t i = 0; i < n; i++) {
        if (p + 4 > nspec) return -1;
        int32_t key = spec[p], dma = spec[p + 1], first = spec[p + 2], nr = spec[p + 3];
        p += 4;
        if (nr < 0 || p + nr + 1 > nspec) return -1;
        const int32_t *reads = spec + p;
        p += nr;
        int32_t nw = spec[p++];
        if (nw < 0 || p + nw > nspec) return -1;
        const int32_t *writes = spec + p;
        p += nw;
        int32_t k = record_at(t, at, idx0 + i, key, dma, reads, nr, writes, nw, first);
        if (k < 0) return -1;
        at += k;
    }
    if (p != nspec) return -1;
    /* [nfirst, ndeps, first..., deps...] per instruction -> offsets, then the values */
    int32_t *tmp = (int32_t *)malloc((size_t)(at > 0 ? at : 1) * sizeof(int32_t));
    if (!tmp) return -1;
    memcpy(tmp, t->out, (size_t)at * sizeof(int32_t));
    int64_t total = (int64_t)2 * n + 1 + (at - (int64_t)2 * n);
    if (out_grow(t, total + 1)) { free(tmp); return -1; }
    int32_t *out = t->out, *vals = t->out + 2 * n + 1;
    int32_t q = 0, pos = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t nf = tmp[q] > 0 ? tmp[q] : 0, nd = tmp[q + 1];
        q += 2;
        out[2 * i] = pos;
        memcpy(vals + pos, tmp + q, (size_t)nf * sizeof(int32_t));
        pos += nf;
        q += nf;
        out[2 * i + 1] = pos;
        memcpy(vals + pos, tmp + q, (size_t)nd * sizeof(int32_t));
        pos += nd;
        q += nd;
    }
    out[2 * n] = pos;
    free(tmp);
    return (int32_t)total;
}

/* ---- the whole state as int64s (pickling a kernel) ---------------------------------------- */

#define DUMP_MAGIC 0x7472646570310001LL

typedef struct {
    int64_t *buf;
    int64_t n, cap;
} sink_t;

static inline void put(sink_t *k, int64_t v) {
    if (k->n < k->cap) k->buf[k->n] = v;
    k->n++;
}

static void put_accs(sink_t *k, const accvec *a) {
    put(k, a->n);
    for (int32_t i = 0; i < a->n; i++) {
        put(k, a->v[i].serial);
        put(k, a->v[i].boff);
        put(k, a->v[i].blen);
        put(k, a->v[i].idx);
        put(k, a->v[i].key);
    }
}

int64_t dt_dump(dt_tracker *t, int64_t *buf, int64_t cap) {
    sink_t k = {buf, 0, buf ? cap : 0};
    put(&k, DUMP_MAGIC);
    put(&k, t->npool);
    for (int64_t i = 0; i < t->npool; i++) put(&k, t->pool[i]);
    put(&k, t->nregions);
    for (int32_t i = 0; i < t->nregions; i++) {
        put(&k, t->regions[i].hid);
        put(&k, t->regions[i].boff);
        put(&k, t->regions[i].blen);
    }
    put(&k, t->nhists);
    for (int32_t i = 0; i < t->nhists; i++) {
        put(&k, t->hists[i].tile);
        put_accs(&k, &t->hists[i].writes);
        put_accs(&k, &t->hists[i].reads);
    }
    put(&k, t->ngraves);
    for (int32_t i = 0; i < t->ngraves; i++) {
        for (int j = 0; j < 4; j++) put(&k, t->graves[i].box[j]);
        put(&k, t->graves[i].hid);
        put(&k, t->graves[i].alive);
        put(&k, t->graves[i].seen);
    }
    for (int sp = 0; sp < 2; sp++) {
        put(&k, t->nbuckets[sp]);
        for (int32_t c = 0; c < t->nbuckets[sp]; c++) {
            put(&k, t->buckets[sp][c].n);
            for (int32_t i = 0; i < t->buckets[sp][c].n; i++) put(&k, t->buckets[sp][c].v[i]);
        }
    }
    put(&k, t->serial);
    put(&k, t->epoch);
    return k.n;
}

typedef struct {
    const int64_t *buf;
    int64_t n, at;
    int bad;
} src_t;

static inline int64_t get(src_t *s, int64_t lo, int64_t hi) {
    if (s->at >= s->n) {
        s->bad = 1;
        return lo;
    }
    int64_t v = s->buf[s->at++];
    if (v < lo || v > hi) s->bad = 1;
    return v;
}

static int get_accs(src_t *s, accvec *a) {
    int32_t n = (int32_t)get(s, 0, 0x7fffffff);
    if (s->bad) return -1;
    if (grow((void **)&a->v, &a->cap, n, sizeof(acc_t))) return -1;
    for (int32_t i = 0; i < n && !s->bad; i++) {
        a->v[i].serial = get(s, INT64_MIN, INT64_MAX);
        a->v[i].boff = (int32_t)get(s, 0, 0x7fffffff);
        a->v[i].blen = (int32_t)get(s, 2, 0x7fffffff);
        a->v[i].idx = (int32_t)get(s, INT32_MIN, INT32_MAX);
        a->v[i].key = (int32_t)get(s, INT32_MIN, INT32_MAX);
    }
    a->n = n;
    return s->bad ? -1 : 0;
}

int32_t dt_load(dt_tracker *t, const int64_t *buf, int64_t n) {
    src_t s = {buf, n, 0, 0};
    if (t->npool || t->nregions || t->nhists || t->ngraves) return -1; /* a fresh tracker only */
    if (get(&s, DUMP_MAGIC, DUMP_MAGIC) != DUMP_MAGIC || s.bad) return -1;
    int64_t np = get(&s, 0, 0x7fffffff);
    int32_t cap = 0;
    if (s.bad || grow((void **)&t->pool, &cap, np ? np : 1, sizeof(int64_t))) return -1;
    t->cappool = cap;
    for (int64_t i = 0; i < np; i++) t->pool[i] = get(&s, INT64_MIN, INT64_MAX);
    t->npool = np;
    int32_t nreg = (int32_t)get(&s, 0, 0x7fffffff);
    if (s.bad || grow((void **)&t->regions, &t->capregions, nreg ? nreg : 1, sizeof(region_t))) return -1;
    for (int32_t i = 0; i < nreg; i++) {
        t->regions[i].hid = (int32_t)get(&s, 0, 0x7fffffff);
        t->regions[i].boff = (int32_t)get(&s, 0, np);
        t->regions[i].blen = (int32_t)get(&s, 2, np);
    }
    t->nregions = nreg;
    int32_t nh = (int32_t)get(&s, 0, 0x7fffffff);
    if (s.bad || grow((void **)&t->hists, &t->caphists, nh ? nh : 1, sizeof(hist_t))) return -1;
    memset(t->hists, 0, (size_t)t->caphists * sizeof(hist_t));
    t->nhists = nh;
    for (int32_t i = 0; i < nh; i++) {
        t->hists[i].tile = (int32_t)get(&s, 0, 1);
        if (get_accs(&s, &t->hists[i].writes) || get_accs(&s, &t->hists[i].reads)) return -1;
    }
    int32_t ng = (int32_t)get(&s, 0, 0x7fffffff);
    if (s.bad || grow((void **)&t->graves, &t->capgraves, ng ? ng : 1, sizeof(grave_t))) return -1;
    for (int32_t i = 0; i < ng; i++) {
        for (int j = 0; j < 4; j++) t->graves[i].box[j] = get(&s, INT64_MIN, INT64_MAX);
        t->graves[i].hid = (int32_t)get(&s, 0, nh - 1);
        t->graves[i].alive = (int32_t)get(&s, 0, 1);
        t->graves[i].seen = get(&s, INT64_MIN, INT64_MAX);
    }
    t->ngraves = ng;
    for (int sp = 0; sp < 2; sp++) {
        int32_t nb = (int32_t)get(&s, 0, 0x7fffffff);
        if (s.bad) return -1;
        if (nb) {
            t->buckets[sp] = (ivec *)calloc((size_t)nb, sizeof(ivec));
            if (!t->buckets[sp]) return -1;
        }
        t->nbuckets[sp] = nb;
        for (int32_t c = 0; c < nb; c++) {
            int32_t m = (int32_t)get(&s, 0, 0x7fffffff);
            ivec *b = &t->buckets[sp][c];
            if (s.bad || grow((void **)&b->v, &b->cap, m ? m : 1, sizeof(int32_t))) return -1;
            for (int32_t i = 0; i < m; i++) b->v[i] = (int32_t)get(&s, 0, ng - 1);
            b->n = m;
        }
    }
    t->serial = get(&s, INT64_MIN, INT64_MAX);
    t->epoch = get(&s, INT64_MIN, INT64_MAX);
    return s.bad || s.at != s.n ? -1 : 0;
}
