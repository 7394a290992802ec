/* dsec BPF: which sandbox the current task is in, and its parent -- the one
 * membership lookup both sensors use: the audit sensor (common.h, process.c,
 * net.c, files.c) and the enforcement sensor (enforce.c).
 *
 * Not #included: BCC rewrites map calls (.lookup, .update ...) only in its
 * main source text, so each loader puts this file first in the one text it
 * compiles (agent/sensors/common.py source_text). Each sensor therefore has
 * its own instance of these maps, filled by its own userspace. The sensor's
 * per-sandbox configuration type comes from the loader as DSEC_SBX_T:
 * struct dsec_sandbox (audit) or struct dsec_enf_sandbox (enforcement).
 *
 * Rules: no kernel struct is dereferenced (only helpers); every loop bounded.
 */
#include "shared.h"

#ifndef DSEC_SBX_T
#error "DSEC_SBX_T (the sensor's per-sandbox configuration type) must be defined by the loader"
#endif

/* cgroup id -> configuration, written by userspace */
BPF_HASH(sandboxes, u64, DSEC_SBX_T, DSEC_MAX_SANDBOXES);
/* bumped by userspace at every registration: invalidates sbx_cgcache */
BPF_ARRAY(sbx_gen, u64, 1);
/* task cgroup id -> its sandbox (0: none), as of sbx_gen[0] */
BPF_TABLE("lru_hash", u64, struct dsec_cg_cache, sbx_cgcache, 16384);
/* in front of it, per CPU: a direct-mapped slot by cgroup id (an array: the
 * lookup is inlined, no hashing, no LRU bookkeeping). A slot can be seen
 * half-written: the cgroup sock_addr programs (egress) run with migration, not
 * preemption, disabled, so on a preemptible kernel another task's program can
 * run on the same CPU between two of their loads or stores (on this kernel,
 * preempt=none, it cannot). A mixed slot must never answer: the slot carries a
 * check over its three words, stored last and verified on every read, and a
 * mismatch is a miss (the hash lookups below, each atomic). */
#define DSEC_L1_SLOTS 256
#define DSEC_L1_CHECK(id, gen, sb) \
    (((id) ^ ((gen) * 0x9E3779B97F4A7C15ULL) ^ ((sb) * 0xC2B2AE3D27D4EB4FULL)) | 1)
BPF_PERCPU_ARRAY(sbx_l1, struct dsec_cg_l1, DSEC_L1_SLOTS);
/* process tree of sandbox tasks: child tgid -> parent tgid, filled at fork */
BPF_TABLE("lru_hash", u32, u32, parents, 65536);

/* The sandbox of the current task: its cgroup2 or the nearest registered
 * ancestor (a sandbox may create sub-cgroups). The per-cgroup answer is cached
 * -- this CPU's slot (sbx_l1), then sbx_cgcache -- and every cache entry is
 * invalidated by userspace bumping sbx_gen when it registers a sandbox (read
 * first: an answer computed across a registration is stale at once). A task
 * outside any sandbox pays one helper call and two inlined array reads; a
 * sandbox's task one hash lookup more (its configuration). */
static __always_inline DSEC_SBX_T *dsec_sandbox(u64 *cgid)
{
    u64 id = bpf_get_current_cgroup_id();
    u32 zero = 0;
    u64 *genp = sbx_gen.lookup(&zero);
    u64 gen = genp ? *genp : 0;
    u32 slot = id & (DSEC_L1_SLOTS - 1);
    struct dsec_cg_l1 *l1 = sbx_l1.lookup(&slot);
    DSEC_SBX_T *cfg = 0;
    volatile struct dsec_cg_l1 *v = l1;     /* each word loaded once, in this order */
    if (v && v->id == id && v->gen == gen) {
        u64 sb = v->sandbox;
        if (v->check != DSEC_L1_CHECK(id, gen, sb))
            goto slow;
        if (!sb)
            return 0;
        cfg = sandboxes.lookup(&sb);
        if (cfg) {
            *cgid = sb;
            return cfg;
        }
        /* that sandbox is gone (removal bumps no generation): asked again below */
    }
slow:;
    u64 sb = 0;
    cfg = sandboxes.lookup(&id);
    if (cfg) {
        sb = id;
    } else {
        struct dsec_cg_cache *c = sbx_cgcache.lookup(&id);
        if (c && c->gen == gen) {
            sb = c->sandbox;
            if (sb)
                cfg = sandboxes.lookup(&sb);
        } else {
            struct dsec_cg_cache nc = {};
            nc.gen = gen;
            /* kept a loop (the verifier walks bounded loops): unrolled, its 15 levels were
             * ~200 instructions in every program of both sensors, each compiled apiece */
#pragma nounroll
            for (int lvl = 1; lvl < DSEC_MAX_LEVEL; lvl++) {
                u64 anc = bpf_get_current_ancestor_cgroup_id(lvl);
                if (anc == 0 || anc == id)
                    break;
                cfg = sandboxes.lookup(&anc);
                if (cfg) {
                    sb = anc;
                    break;
                }
            }
            nc.sandbox = sb;
            sbx_cgcache.update(&id, &nc);
        }
    }
    if (v) {
        u64 ans = cfg ? sb : 0;
        v->id = id;
        v->gen = gen;
        v->sandbox = ans;
        v->check = DSEC_L1_CHECK(id, gen, ans);
    }
    if (cfg)
        *cgid = sb;
    return cfg;
}

/* A fork of the current task (task/task_newtask, not a thread): remember the
 * child's parent when the task is in a sandbox (CLONE_PARENT: the parent's
 * parent). Returns the sandbox's configuration (and *cgid), or 0. */
static __always_inline DSEC_SBX_T *dsec_track_fork(u32 child, u64 flags, u64 *cgid)
{
    DSEC_SBX_T *cfg = dsec_sandbox(cgid);
    if (!cfg)
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 parent = tgid;
    if (flags & DSEC_CLONE_PARENT) {
        u32 *pp = parents.lookup(&tgid);
        parent = pp ? *pp : 0;
    }
    parents.update(&child, &parent);
    return cfg;
}

/* the last thread of tgid is gone (sched_process_exit, group_dead) */
static __always_inline void dsec_track_exit(u32 tgid)
{
    /* looked up first: a delete takes the bucket lock even for a key that is
     * not there -- every process of the node exits through here */
    if (parents.lookup(&tgid))
        parents.delete(&tgid);
}

/* The header of a record of the current task, its parent included. */
static __always_inline void dsec_fill_hdr(struct dsec_hdr *h, u32 kind, u64 cgid, u32 step)
{
    u32 tgid = dsec_hdr_fill(h, kind, cgid, step);
    u32 *pp = parents.lookup(&tgid);
    h->ppid = pp ? *pp : 0;
}
