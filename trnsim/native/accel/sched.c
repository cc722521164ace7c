/* The kernel scheduler's event loop (trnsim.native.accel._sched).
 *
 * It runs the processes of trnsim.sim's simpy model - one per engine and one per DMA queue of
 * every core - over the same event queue discipline as simpy 4: events ordered by (tick,
 * priority, event id), process starts URGENT and everything else NORMAL, an event id taken at
 * every schedule, and the processes waiting on one event resumed in the order they began to
 * wait. So every reservation of a core's DMA engines and of an HBM stack happens in the order
 * the simpy model makes it, ties included, and every tick comes out the same
 * (tests/sim/test_sim_equivalence.py compares the two on every library kernel).
 *
 * What is per instruction and independent of the order of events - issue and latency ticks,
 * TensorE's LoadStationary / MultiplyMoving ticks, a DMA plan's per-engine ticks - is worked out
 * by the engine modules in Python (trnsim/sim.py, _NativeRun). The state that evolves with
 * simulated time lives here: each engine's `free`, TensorE's overlap and power-ramp state (the
 * rules of trnsim/cores/tensor.py TensorEngine.plan and Engine.plan in trnsim/cores/base.py),
 * the DMA engines and the HBM bandwidth pipes (trnsim/memory/dma.py DmaSystem.reserve,
 * trnsim/bandwidth.py BandwidthPipe.reserve).
 *
 * Built without -ffast-math and with -ffp-contract=off: the power ramp's utilisation is the same
 * IEEE double arithmetic as the Python model's.
 */
#include "sched.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define URGENT 0
#define NORMAL 1

#define EV_PROC 0  /* start or resume a process (its Initialize or Timeout event) */
#define EV_READY 1 /* an instruction's results became visible: wake its waiters */
#define EV_TRIG 2  /* a DMA trigger is done: wake its queue                      */

/* engine process phases */
#define PH_DEPS 0   /* gathering the current instruction's dependencies */
#define PH_FINISH 1 /* placed; waiting for its start tick               */

typedef struct {
    int64_t time;
    int64_t key;  /* priority << 56 | event id */
    int64_t what; /* type << 32 | argument     */
} event_t;

typedef struct {
    event_t *ev;
    int64_t len, cap, eid;
} heap_t;

static inline int ev_less(const event_t *a, const event_t *b) {
    return a->time < b->time || (a->time == b->time && a->key < b->key);
}

static int heap_push(heap_t *h, int64_t time, int prio, int type, int64_t arg) {
    if (h->len == h->cap) {
        int64_t cap = h->cap ? 2 * h->cap : 1024;
        event_t *ev = realloc(h->ev, (size_t)cap * sizeof(event_t));
        if (!ev) return -1;
        h->ev = ev;
        h->cap = cap;
    }
    event_t e = {time, ((int64_t)prio << 56) | h->eid++, ((int64_t)type << 32) | arg};
    int64_t i = h->len++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!ev_less(&e, &h->ev[parent])) break;
        h->ev[i] = h->ev[parent];
        i = parent;
    }
    h->ev[i] = e;
    return 0;
}

static event_t heap_pop(heap_t *h) {
    event_t top = h->ev[0];
    event_t last = h->ev[--h->len];
    int64_t i = 0, n = h->len;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && ev_less(&h->ev[c + 1], &h->ev[c])) c++;
        if (!ev_less(&h->ev[c], &last)) break;
        h->ev[i] = h->ev[c];
        i = c;
    }
    if (n) h->ev[i] = last;
    return top;
}

typedef struct {
    sched_run_t *r;
    heap_t heap;
    int64_t now;
    /* per process */
    int64_t *pos, *cursor, *t, *last;
    int8_t *phase;
    int64_t *p_start, *p_mm_start, *p_end, *p_ready, *p_ls_start, *p_ls_end;
    int32_t *next_waiter;
    /* per instruction: processes waiting on its results / on its trigger (FIFO lists) */
    int32_t *ready_head, *ready_tail, *trig_head, *trig_tail;
} loop_t;

static inline void wait_on(loop_t *L, int32_t *head, int32_t *tail, int64_t g, int32_t p) {
    L->next_waiter[p] = -1;
    if (head[g] < 0) head[g] = p;
    else L->next_waiter[tail[g]] = p;
    tail[g] = p;
}

static inline void log_seg(sched_run_t *r, int64_t g, int kind, int64_t s, int64_t e) {
    int64_t k = r->nseg++;
    r->seg_index[k] = (int32_t)g;
    r->seg_kind[k] = (int8_t)kind;
    r->seg_start[k] = s;
    r->seg_end[k] = e;
}

/* TensorEngine.utilisation_limit */
static double utilisation(sched_run_t *r, int64_t *ts, int64_t t_start) {
    if (r->initial_util >= 1.0) return 1.0;
    if (!ts[5] || t_start - ts[3] >= r->idle_reset_ticks) {
        ts[4] = t_start;
        ts[5] = 1;
    }
    if (r->ramp_ticks == 0) return 1.0;
    double frac = (double)(t_start - ts[4]) / (double)r->ramp_ticks;
    double u = r->initial_util + (1.0 - r->initial_util) * frac;
    return u < 1.0 ? u : 1.0;
}

/* Engine.plan / TensorEngine.plan: place instruction g; store start, end, ready. */
static void plan(loop_t *L, int32_t p, int64_t g, int64_t t_dep, int64_t t_first) {
    sched_run_t *r = L->r;
    int64_t *free = &r->engine_free[p];
    int8_t kind = r->kind[g];
    if (kind != SCHED_TENSOR) {
        int64_t start = t_dep > *free ? t_dep : *free;
        int64_t end = start + r->busy[g];
        *free = end;
        L->p_start[p] = L->p_mm_start[p] = start;
        L->p_end[p] = end;
        L->p_ready[p] = kind == SCHED_TRIGGER ? end : end + r->lat[g];
        return;
    }
    int64_t *ts = &r->tensor_state[6 * (int64_t)p];
    int64_t ls_ticks = r->ls[g], ls_start, ls_end;
    if (ls_ticks) {
        int64_t gate = r->overlap_ls ? ts[1] : ts[2];
        ls_start = t_first;
        if (ts[0] > ls_start) ls_start = ts[0];
        if (gate > ls_start) ls_start = gate;
        ls_end = ls_start + ls_ticks;
        ts[0] = ls_end;
    } else {
        ls_start = ls_end = t_dep;
    }
    int64_t mm_start = ls_end;
    if (*free > mm_start) mm_start = *free;
    if (t_dep > mm_start) mm_start = t_dep;
    double util = utilisation(r, ts, mm_start);
    int64_t mm_ticks = util >= 1.0 ? r->busy[g] : (int64_t)ceil((double)r->busy[g] / util);
    int64_t mm_end = mm_start + mm_ticks;
    int64_t ready = mm_end + r->drain_ticks;
    *free = mm_end;
    ts[1] = mm_start;
    ts[2] = ready;
    ts[3] = mm_end;
    L->p_ls_start[p] = ls_start;
    L->p_ls_end[p] = ls_end;
    L->p_start[p] = ls_ticks ? ls_start : mm_start;
    L->p_mm_start[p] = mm_start;
    L->p_end[p] = mm_end;
    L->p_ready[p] = ready;
}

/* CoreTimeline._engine, from where process p stopped. */
static int run_engine(loop_t *L, int32_t p) {
    sched_run_t *r = L->r;
    const int32_t *instrs = r->proc_instr + r->proc_off[p];
    int64_t count = r->proc_off[p + 1] - r->proc_off[p];
    int64_t base = r->core_base[r->proc_core[p]];
    int32_t own = r->proc_own[p];
    while (L->pos[p] < count) {
        int64_t g = instrs[L->pos[p]];
        if (L->phase[p] == PH_DEPS) {
            int64_t t = L->t[p];
            for (int64_t k = r->dep_off[g] + L->cursor[p]; k < r->dep_off[g + 1]; k++) {
                int64_t d = base + r->deps[k];
                int64_t rd = r->ready[d];
                if (rd < 0) { /* wait for d's results; resume at this dependency */
                    L->cursor[p] = k - r->dep_off[g];
                    L->t[p] = t;
                    wait_on(L, L->ready_head, L->ready_tail, d, p);
                    return 0;
                }
                if (r->owner[d] == own) rd = r->end[d];
                if (rd > t) t = rd;
            }
            int64_t t_first = t;
            if (r->has_first[g]) {
                t_first = L->now;
                for (int64_t k = r->first_off[g]; k < r->first_off[g + 1]; k++) {
                    int64_t d = base + r->first_deps[k];
                    int64_t rd = r->owner[d] == own ? r->end[d] : r->ready[d];
                    if (rd > t_first) t_first = rd;
                }
            }
            plan(L, p, g, t, t_first);
            L->phase[p] = PH_FINISH;
            if (L->p_start[p] > L->now) {
                if (heap_push(&L->heap, L->p_start[p], NORMAL, EV_PROC, p)) return -1;
                return 0;
            }
        }
        /* PH_FINISH: the instruction starts now */
        if (r->kind[g] == SCHED_TENSOR && r->ls[g]) log_seg(r, g, SEG_LS, L->p_ls_start[p], L->p_ls_end[p]);
        log_seg(r, g, SEG_MAIN, L->p_mm_start[p], L->p_end[p]);
        r->end[g] = L->p_end[p];
        if (r->kind[g] == SCHED_TRIGGER) {
            r->trigger[g] = L->p_end[p];
            if (L->trig_head[g] >= 0 && heap_push(&L->heap, L->now, NORMAL, EV_TRIG, g)) return -1;
        } else {
            r->ready[g] = L->p_ready[p];
            if (L->ready_head[g] >= 0 && heap_push(&L->heap, L->now, NORMAL, EV_READY, g)) return -1;
        }
        L->pos[p]++;
        L->phase[p] = PH_DEPS;
        L->cursor[p] = 0;
        L->t[p] = L->now;
    }
    return 0;
}

/* CoreTimeline._queue with DmaSystem.reserve, from where process p stopped. */
static int run_queue(loop_t *L, int32_t p) {
    sched_run_t *r = L->r;
    const int32_t *instrs = r->proc_instr + r->proc_off[p];
    int64_t count = r->proc_off[p + 1] - r->proc_off[p];
    int32_t core = r->proc_core[p];
    int64_t *dfree = r->dma_free + (int64_t)core * r->dma_engines;
    int64_t *pipe = &r->pipe_free[r->core_stack[core]];
    while (L->pos[p] < count) {
        int64_t g = instrs[L->pos[p]];
        int64_t trig = r->trigger[g];
        if (trig < 0) {
            wait_on(L, L->trig_head, L->trig_tail, g, p);
            return 0;
        }
        int64_t t0 = trig + r->start_latency;
        if (t0 > L->now) {
            if (heap_push(&L->heap, t0, NORMAL, EV_PROC, p)) return -1;
            return 0;
        }
        int64_t start = L->now, fin = start, first = -1;
        int32_t pl = r->plan[g];
        for (int64_t k = r->plan_off[pl]; k < r->plan_off[pl + 1]; k++) {
            int32_t e = r->plan_engine[k];
            int64_t s = dfree[e] > start ? dfree[e] : start;
            if (first < 0 || s < first) first = s;
            int64_t f = s + r->plan_ticks[k];
            dfree[e] = f;
            if (f > fin) fin = f;
        }
        if (r->plan_hbm[pl]) {
            int64_t begin = *pipe > start ? *pipe : start;
            *pipe = begin + r->plan_hbm_ticks[pl];
            if (*pipe > fin) fin = *pipe;
        }
        int64_t data_start = first < 0 ? start : first;
        fin += r->transfer_latency;
        if (L->last[p] > fin) fin = L->last[p];
        L->last[p] = fin;
        r->end[g] = fin;
        log_seg(r, g, SEG_DMA, data_start, fin);
        r->ready[g] = fin;
        if (L->ready_head[g] >= 0 && heap_push(&L->heap, L->now, NORMAL, EV_READY, g)) return -1;
        L->pos[p]++;
    }
    return 0;
}

static inline int resume(loop_t *L, int32_t p) {
    return L->r->proc_queue[p] ? run_queue(L, p) : run_engine(L, p);
}

static void *zalloc(size_t n, size_t size, int *fail) {
    void *p = calloc(n ? n : 1, size);
    if (!p) *fail = 1;
    return p;
}

int sched_run(sched_run_t *r) {
    loop_t L;
    memset(&L, 0, sizeof L);
    L.r = r;
    int fail = 0;
    int64_t np = r->nproc, n = r->n;
    L.pos = zalloc(np, sizeof(int64_t), &fail);
    L.cursor = zalloc(np, sizeof(int64_t), &fail);
    L.t = zalloc(np, sizeof(int64_t), &fail);
    L.last = zalloc(np, sizeof(int64_t), &fail);
    L.phase = zalloc(np, sizeof(int8_t), &fail);
    L.p_start = zalloc(np, sizeof(int64_t), &fail);
    L.p_end = zalloc(np, sizeof(int64_t), &fail);
    L.p_mm_start = zalloc(np, sizeof(int64_t), &fail);
    L.p_ready = zalloc(np, sizeof(int64_t), &fail);
    L.p_ls_start = zalloc(np, sizeof(int64_t), &fail);
    L.p_ls_end = zalloc(np, sizeof(int64_t), &fail);
    L.next_waiter = zalloc(np, sizeof(int32_t), &fail);
    L.ready_head = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    L.ready_tail = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    L.trig_head = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    L.trig_tail = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    int rc = 0;
    if (fail || !L.ready_head || !L.ready_tail || !L.trig_head || !L.trig_tail) {
        rc = -1;
        goto done;
    }
    memset(L.ready_head, 0xff, (size_t)n * sizeof(int32_t));
    memset(L.trig_head, 0xff, (size_t)n * sizeof(int32_t));
    for (int64_t i = 0; i < n; i++) r->ready[i] = r->trigger[i] = -1;
    memset(r->end, 0, (size_t)n * sizeof(int64_t));
    r->nseg = 0;
    r->events = 0;
    /* env.process(...) for each process: an URGENT Initialize event at tick 0 */
    for (int32_t p = 0; p < np; p++)
        if (heap_push(&L.heap, 0, URGENT, EV_PROC, p)) { rc = -1; goto done; }
    while (L.heap.len) {
        event_t ev = heap_pop(&L.heap);
        L.now = ev.time;
        r->events++;
        int type = (int)(ev.what >> 32);
        int64_t arg = ev.what & 0xffffffff;
        if (type == EV_PROC) {
            if (resume(&L, (int32_t)arg)) { rc = -1; goto done; }
            continue;
        }
        int32_t *head = type == EV_READY ? L.ready_head : L.trig_head;
        int32_t p = head[arg];
        head[arg] = -1;
        while (p >= 0) { /* the callbacks in the order they were added */
            int32_t next = L.next_waiter[p];
            if (resume(&L, p)) { rc = -1; goto done; }
            p = next;
        }
    }
done:
    free(L.heap.ev);
    free(L.pos); free(L.cursor); free(L.t); free(L.last); free(L.phase);
    free(L.p_start); free(L.p_mm_start); free(L.p_end); free(L.p_ready); free(L.p_ls_start); free(L.p_ls_end);
    free(L.next_waiter);
    free(L.ready_head); free(L.ready_tail); free(L.trig_head); free(L.trig_tail);
    return rc;
}
