/* The kernel scheduler's event loop in C (trnsim.native.accel._sched): see sched.c. */
#ifndef TRNSIM_SCHED_H
#define TRNSIM_SCHED_H

#include <stdint.h>

/* Instruction kinds (sim_run's `kind`). */
#define SCHED_GENERIC 0 /* in-order engine op: start = max(deps, free), busy, then latency   */
#define SCHED_TRIGGER 1 /* a DMA trigger on an engine; its transfer runs on a queue process  */
#define SCHED_TENSOR 2  /* TensorE LoadStationary + MultiplyMoving (matmul, transpose)       */

/* Segment kinds in the output log. */
#define SEG_MAIN 0 /* the instruction's own segment on its engine (or its DMA trigger)    */
#define SEG_LS 1   /* TensorE LoadStationary                                              */
#define SEG_DMA 2  /* a transfer's data movement on its queue lane                       */

typedef struct {
    /* ---- instructions: all cores concatenated; deps are indices local to their core ---- */
    int64_t n;
    const int8_t *kind;
    const int64_t *busy;      /* GENERIC: issue ticks; TRIGGER: trigger ticks; TENSOR: MM ticks at full rate */
    const int64_t *lat;       /* GENERIC: result latency ticks                                  */
    const int64_t *ls;        /* TENSOR: LoadStationary ticks, 0 when skipped                   */
    const int32_t *owner;     /* engine id (non-DMA) or queue id (DMA), per core               */
    const int64_t *dep_off;   /* n + 1 offsets into deps                                        */
    const int32_t *deps;
    const int64_t *first_off; /* n + 1 offsets into first_deps                                  */
    const int32_t *first_deps;
    const int8_t *has_first;  /* 0: first_deps is None (the whole instruction waits for deps) */
    const int32_t *plan;      /* DMA: index of its plan                                         */
    /* ---- processes, in simpy creation order ---------------------------------------------- */
    int32_t nproc;
    const int8_t *proc_queue;   /* 0: engine process, 1: DMA queue process                     */
    const int32_t *proc_core;
    const int32_t *proc_own;    /* engine whose own results pipeline (owner id), or -1          */
    const int64_t *proc_off;    /* nproc + 1 offsets into proc_instr                            */
    const int32_t *proc_instr;  /* global instruction indices, program order                    */
    const int64_t *core_base;   /* first global index of each core                              */
    /* ---- TensorE (the same on every core) -------------------------------------------------- */
    int32_t overlap_ls;
    int64_t drain_ticks, ramp_ticks, idle_reset_ticks;
    double initial_util;
    /* ---- DMA -------------------------------------------------------------------------------- */
    int32_t ncores, dma_engines;
    int64_t start_latency, transfer_latency;
    const int32_t *core_stack;  /* HBM stack of each core                                        */
    const int64_t *plan_off;    /* nplans + 1 offsets into plan_engine / plan_ticks              */
    const int32_t *plan_engine;
    const int64_t *plan_ticks;
    const int8_t *plan_hbm;     /* the plan moves HBM bytes                                      */
    const int64_t *plan_hbm_ticks;
    /* ---- state in / out ----------------------------------------------------------------------- */
    int64_t *engine_free;       /* nproc: each engine process's `free` (queues: unused)          */
    int64_t *tensor_state;      /* nproc x 6: ls_free, last_mm_start, last_mm_ready, last_mm_end,
                                   ramp_start, ramp_set                                          */
    int64_t *dma_free;          /* ncores x dma_engines                                          */
    int64_t *pipe_free;         /* per HBM stack                                                 */
    /* ---- results ------------------------------------------------------------------------------ */
    int64_t *ready;             /* -1: never ran                                                 */
    int64_t *end;
    int64_t *trigger;           /* -1: not a DMA / never triggered                               */
    int64_t nseg;               /* out: segments logged (capacity 2 n)                           */
    int32_t *seg_index;         /* global instruction index                                      */
    int8_t *seg_kind;
    int64_t *seg_start, *seg_end;
    int64_t events;             /* out: events processed                                         */
} sched_run_t;

/* Run the event loop to completion; 0 on success, -1 when out of memory. */
int sched_run(sched_run_t *r);

#endif
