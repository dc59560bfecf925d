/* shardpar shared-memory intra-node transport (plain C11 + Linux; no Python, no torch).
 *
 * [Note: shm segment layout]
 *
 *   /dev/shm/shardpar-<key>-<group>   (mode 0600, unlinked as soon as every rank attached; the name is
 *                                      a secret until then, see [Note: shm trust])
 *
 *   +-----------------+---------------------------------+---------+-------------------------------------+
 *   | shm_header      | rank_ctl[0] ... rank_ctl[n-1]   | pad to  | slot[r][b], r < n, b < NUM_BUFS,     |
 *   | (magic, counts, | one 128-byte line each: counter,| 4 KiB   | chunk_bytes each, page aligned:      |
 *   |  abort word)    | pid, cpu, closed, call ring     |         | slot[0][0] slot[0][1] slot[1][0] ... |
 *   +-----------------+---------------------------------+---------+-------------------------------------+
 *
 * [Note: shm synchronisation]
 * Every rank owns one monotonically increasing 32-bit counter (`cnt`). All ranks run the same sequence
 * of collectives, so their counters step through the same values: "publish" bumps my counter, and
 * "peer j reached v" means peer j finished the same phase I did when my counter was v. Data moves in
 * steps of one chunk through a rank's own slot; each rank double-buffers (NUM_BUFS slots), so it may
 * write step s+1 while peers still read step s. Before it rewrites slot b it waits until every peer
 * published "done reading" for the last step that used b (`free_seq[b]`).
 * Waiting spins briefly (50 us when every rank has a core, 1 us when ranks outnumber cores, not at all
 * when the peer last ran on my CPU: 2 ranks that the scheduler put on one CPU took 65 us per 64 KiB
 * all-gather with the spin, 15 us without), then calls sched_yield() for up to 200 us (hands the core
 * to a peer that is runnable: 4 ranks on 2 cores, 64 KiB all-gather 60-85 -> 30-50 us), then sleeps on
 * the peer's counter with a futex (process-shared) in short slices: pure spinning is 60x slower when
 * ranks outnumber cores. A "patient" communicator (shm_comm_set_wait) sleeps at once: the smddp engine
 * asks for it on its worker thread, whose collectives overlap the rank's own compute, which a spinning
 * or yielding waiter slows down (25m training step, 2 ranks on 2 cores: 8-16 % less CPU per step,
 * docs/performance-history.md item 8). Between slices it checks the abort word, the peer's `closed` flag, the deadline
 * (-> SHM_ETIMEDOUT naming the peer) and, every 50 ms, whether every peer process is still alive
 * (kill(pid, 0) plus the zombie state in /proc -> SHM_EPEERDEAD).
 * The first rank to fail stores the reason in the abort word and wakes everyone, so peers fail fast with
 * the same reason instead of waiting out their own timeouts.
 *
 * [Note: shm name lifetime]
 * Index 0 creates the segment (O_EXCL, 0600); the others retry shm_open until it exists. The last rank to
 * attach unlinks the name at once: the mappings stay valid, and no later crash (even SIGKILL of every
 * rank) can leak a /dev/shm entry. Before that point a failing rank (timeout, dead creator) unlinks it;
 * the name stays only if the ranks that did attach are killed inside the attach window, e.g. a creator
 * stopped by its launcher while it waits for a member that already failed (the next creator with the
 * same key then fails with EEXIST and says so). Callers attach when every member is known to be alive
 * (at group construction) to keep that window short.
 *
 * [Note: shm trust]
 * Trusted: the job's user (one effective uid) and its ranks. /dev/shm is world-writable and its listing
 * world-readable, so another local user can see a name once it exists and can create any name not yet
 * taken. So (1) callers make names unguessable and never show one before it is used: the Python side
 * derives each name from a secret drawn per job (or per process group) and exchanged over the process
 * group, never through /dev/shm; (2) the creator uses O_EXCL with mode 0600 and never adopts an existing
 * segment; (3) a joiner maps a segment only when fstat says it belongs to our effective uid and grants
 * no group/other bits: a segment that another uid created (or made accessible) under our name is
 * refused with SHM_EFOREIGN naming its owner and path, and is neither mapped nor unlinked (it is not
 * ours; /dev/shm's sticky bit would refuse the unlink anyway unless we are root). Another uid can at
 * worst take a name first, which fails the job with that error -- it cannot attach (0600), feed data
 * or read it. Processes of the job's own uid are trusted: they can open, map and write our segments
 * (as they could ptrace the ranks).
 */
#define _GNU_SOURCE
#include "shm_transport.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pwd.h>
#include <linux/futex.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SHM_X86 1
#else
#define SHM_X86 0
#endif

#define SHM_API __attribute__((visibility("default")))

#define SHM_MAGIC 0x53504d31u /* "SPM1" */
#define SHM_VERSION 1u
#define SHM_MAX_RANKS 64
#define NUM_BUFS 2
#define CALL_RING 8
#define LINE 128 /* two cache lines: the adjacent-line prefetcher would otherwise share them */
#define PAGE 4096u
#define PIECE_ALIGN 64u
#define NT_MIN_BYTES (8u << 20)       /* outputs above this are written with non-temporal stores */
#define SMALL_ALLREDUCE_BYTES (64u << 10) /* at or below: one-phase all-reduce (fewer syncs) */
#define LIVENESS_PERIOD_NS 50000000LL
#define MAX_TIMEOUT_S 1e6
#define YIELD_NS 200000LL /* after the spin, sched_yield() this long before sleeping */
#define SLEEP_SLICE_NS 20000000LL

/* ------------------------------------------------------------------------------------------------ */
/* segment layout                                                                                    */

typedef struct {
    _Atomic uint32_t cnt;
    _Atomic int32_t pid;
    _Atomic uint32_t closed;
    _Atomic int32_t cpu; /* where this rank last ran: no point spinning for a peer that shares my CPU */
    _Atomic uint64_t pidns;                /* inode of /proc/self/ns/pid: pids compare only within one */
    _Atomic uint64_t call_ring[CALL_RING]; /* (call number << 32) | descriptor hash, for mismatch checks */
    char pad[LINE - 24 - 8 * CALL_RING];
} rank_ctl;

typedef struct {
    _Atomic uint32_t magic;
    uint32_t version;
    uint32_t nranks;
    uint32_t num_bufs;
    uint64_t chunk_bytes;
    uint64_t total_bytes;
    uint64_t data_offset;
    _Atomic uint32_t attached;
    _Atomic uint32_t sleepers; /* ranks inside futex_wait: publishers skip the wake syscall when 0 */
    _Atomic uint64_t abort_word; /* 0, or kind | culprit | reporter, see pack_abort */
    char pad[LINE - 56];
} shm_header;

_Static_assert(sizeof(rank_ctl) == LINE, "rank_ctl must be one line");
_Static_assert(sizeof(shm_header) == LINE, "shm_header must be one line");

struct shm_comm {
    shm_header *hdr;
    rank_ctl *ctl;
    char *data;
    size_t map_bytes;
    int index, nranks;
    uint64_t chunk_bytes;
    double timeout_s;
    long long spin_ns, yield_ns; /* how a wait spins, then yields, before it sleeps: shm_comm_set_wait */
    long long auto_spin_ns;      /* the spin picked at connect time from ranks vs cores */
    uint32_t seq;                /* my counter; every rank's counter takes the same values */
    uint32_t free_seq[NUM_BUFS]; /* peers must reach this before I rewrite my slot b */
    uint32_t step;               /* chunk steps so far: picks the slot buffer */
    uint32_t call;               /* collectives so far */
    uint64_t desc;               /* this call's descriptor hash */
    uint64_t checked;            /* peers whose descriptor was checked in this call */
    uint64_t pidns;              /* my pid namespace: peers in another one cannot be watched */
    pid_t owner;                 /* the process that attached; a fork()ed child must not use or close it */
    int unlinked;
    const char *op;
    char name[256];
    char err[1024];
};

static inline char *slot(const shm_comm *c, int rank, uint32_t buf) {
    return c->data + ((size_t)rank * NUM_BUFS + buf) * c->chunk_bytes;
}

/* ------------------------------------------------------------------------------------------------ */
/* small helpers                                                                                     */

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void sleep_ns(long long ns) {
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    nanosleep(&ts, NULL);
}

static inline void cpu_relax(void) {
#if SHM_X86
    __builtin_ia32_pause();
#endif
}

static inline int reached(uint32_t value, uint32_t target) { return (int32_t)(value - target) >= 0; }

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected, long long timeout_ns) {
    struct timespec ts = {(time_t)(timeout_ns / 1000000000LL), (long)(timeout_ns % 1000000000LL)};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Record the message of a failure; returns `code` so that callers can `return fail(...)`. */
__attribute__((format(printf, 3, 4))) static int fail(shm_comm *c, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof(c->err), fmt, ap);
    va_end(ap);
    return code;
}

/* Alive = kill(pid, 0) succeeds and the process is not a zombie (a SIGKILLed rank stays a zombie until
 * its parent reaps it, and kill() still succeeds on zombies). */
static int pid_alive(pid_t pid) {
    if (kill(pid, 0) != 0) return errno == EPERM;
    char path[64], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno != ENOENT;
    ssize_t got = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (got <= 0) return 1;
    buf[got] = '\0';
    const char *paren = strrchr(buf, ')');
    if (paren == NULL || paren[1] == '\0' || paren[2] == '\0') return 1;
    return paren[2] != 'Z' && paren[2] != 'X';
}

/* ------------------------------------------------------------------------------------------------ */
/* abort word: kind (8 bits, -status) | culprit + 1 (8 bits) | reporter + 1 (8 bits)                */

static uint64_t pack_abort(int code, int culprit, int reporter) {
    return (uint64_t)(-code) | ((uint64_t)(culprit + 1) << 8) | ((uint64_t)(reporter + 1) << 16);
}

static void wake_everyone(shm_comm *c) {
    for (int r = 0; r < c->nranks; r++) futex_wake_all(&c->ctl[r].cnt);
    futex_wake_all(&c->hdr->attached);
}

static int raise_abort(shm_comm *c, int code, int culprit) {
    uint64_t expected = 0;
    atomic_compare_exchange_strong(&c->hdr->abort_word, &expected, pack_abort(code, culprit, c->index));
    wake_everyone(c);
    return code;
}

static int abort_status(shm_comm *c, uint64_t word) {
    int code = -(int)(word & 0xff);
    int culprit = (int)((word >> 8) & 0xff) - 1;
    int reporter = (int)((word >> 16) & 0xff) - 1;
    char what[64];
    if (code == SHM_ETIMEDOUT)
        snprintf(what, sizeof(what), "did not arrive within %g s", c->timeout_s);
    else
        snprintf(what, sizeof(what), "%s", code == SHM_EPEERDEAD   ? "died"
                                           : code == SHM_EPEERGONE ? "closed its communicator"
                                                                   : "called a different collective");
    return fail(c, code, "shm %s: rank %d (local index) %s (reported by rank %d; the communicator is aborted)",
                c->op, culprit, what, reporter);
}

static uint64_t pid_namespace(void) {
    struct stat sb;
    return stat("/proc/self/ns/pid", &sb) == 0 ? (uint64_t)sb.st_ino : 0;
}

static int check_liveness(shm_comm *c) {
    for (int r = 0; r < c->nranks; r++) {
        int32_t pid = atomic_load(&c->ctl[r].pid);
        if (r == c->index || pid <= 0 || atomic_load(&c->ctl[r].pidns) != c->pidns) continue;
        if (!pid_alive(pid)) {
            fail(c, SHM_EPEERDEAD, "shm %s: rank %d (local index, pid %d) died", c->op, r, (int)pid);
            return raise_abort(c, SHM_EPEERDEAD, r);
        }
    }
    return SHM_OK;
}

/* ------------------------------------------------------------------------------------------------ */
/* waiting                                                                                           */

/* Sleep on *addr (while it equals `seen`) for at most `ns`; counted in `sleepers` so that publishers
 * know to wake. The seq_cst increment and reload pair with the publisher's store + load (Dekker). */
static void sleep_on(shm_comm *c, _Atomic uint32_t *addr, uint32_t seen, long long ns) {
    atomic_fetch_add(&c->hdr->sleepers, 1);
    if (atomic_load(addr) == seen && atomic_load(&c->hdr->abort_word) == 0) futex_wait(addr, seen, ns);
    atomic_fetch_sub(&c->hdr->sleepers, 1);
}

static int check_desc(shm_comm *c, int peer) {
    c->checked |= 1ull << peer;
    uint64_t theirs = atomic_load(&c->ctl[peer].call_ring[c->call % CALL_RING]);
    if ((uint32_t)(theirs >> 32) != c->call || (uint32_t)theirs == (uint32_t)c->desc) return SHM_OK;
    fail(c, SHM_EMISMATCH, "shm %s: rank %d (local index) called a different collective or size (call %u)",
         c->op, peer, c->call);
    return raise_abort(c, SHM_EMISMATCH, peer);
}

/* Wait until peer's counter reaches target. */
static int wait_peer(shm_comm *c, int peer, uint32_t target) {
    _Atomic uint32_t *cnt = &c->ctl[peer].cnt;
    long long start = 0, last_check = 0, spin_ns = c->spin_ns;
    for (;;) {
        uint32_t v = atomic_load_explicit(cnt, memory_order_acquire);
        if (reached(v, target)) break;
        uint64_t ab = atomic_load(&c->hdr->abort_word);
        if (ab != 0) return abort_status(c, ab);
        long long t = now_ns();
        if (start == 0) {
            start = last_check = t;
            int cpu = sched_getcpu();
            atomic_store_explicit(&c->ctl[c->index].cpu, cpu, memory_order_relaxed);
            if (cpu == atomic_load_explicit(&c->ctl[peer].cpu, memory_order_relaxed)) spin_ns = 0;
        }
        if (t - start < spin_ns) {
            for (int i = 0; i < 4; i++) cpu_relax();
            continue;
        }
        if (t - start < spin_ns + c->yield_ns) {
            sched_yield();
            continue;
        }
        if (atomic_load(&c->ctl[peer].closed)) {
            if (reached(atomic_load(cnt), target)) break;
            fail(c, SHM_EPEERGONE, "shm %s: rank %d (local index) closed its communicator", c->op, peer);
            return raise_abort(c, SHM_EPEERGONE, peer);
        }
        long long deadline = start + (long long)(c->timeout_s * 1e9);
        if (t >= deadline) {
            fail(c, SHM_ETIMEDOUT, "shm %s: rank %d (local index) did not arrive within %g s", c->op, peer,
                 c->timeout_s);
            return raise_abort(c, SHM_ETIMEDOUT, peer);
        }
        if (t - last_check >= LIVENESS_PERIOD_NS) {
            last_check = t;
            int st = check_liveness(c);
            if (st != SHM_OK) return st;
        }
        long long slice = deadline - t < SLEEP_SLICE_NS ? deadline - t : SLEEP_SLICE_NS;
        sleep_on(c, cnt, v, slice);
    }
    return (c->checked >> peer) & 1 ? SHM_OK : check_desc(c, peer);
}

static int wait_all(shm_comm *c, uint32_t target) {
    for (int k = 1; k < c->nranks; k++) {
        int st = wait_peer(c, (c->index + k) % c->nranks, target);
        if (st != SHM_OK) return st;
    }
    return SHM_OK;
}

static void publish(shm_comm *c, uint32_t by) {
    atomic_store_explicit(&c->ctl[c->index].cpu, sched_getcpu(), memory_order_relaxed);
    c->seq += by;
    atomic_store(&c->ctl[c->index].cnt, c->seq); /* seq_cst: release for the data, and Dekker with sleepers */
    if (atomic_load(&c->hdr->sleepers) != 0) futex_wake_all(&c->ctl[c->index].cnt);
}

/* Next slot buffer, once every peer finished reading what I last wrote into it. */
static int acquire_buf(shm_comm *c, uint32_t *buf) {
    *buf = c->step++ % NUM_BUFS;
    return wait_all(c, c->free_seq[*buf]);
}

static uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x100000001b3ull; /* FNV-1a step */ }

static uint64_t hash_str(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    while (*s) h = mix(h, (unsigned char)*s++);
    return h;
}

/* Start a collective: refuse on an aborted communicator, record the call descriptor for peers. */
static int begin_call(shm_comm *c, const char *op, uint64_t a, uint64_t b, uint64_t d) {
    c->op = op;
    if (getpid() != c->owner)
        return fail(c, SHM_EINVAL, "shm %s: communicator used in a fork()ed child of pid %d", op, (int)c->owner);
    uint64_t ab = atomic_load(&c->hdr->abort_word);
    if (ab != 0) return abort_status(c, ab);
    c->call++;
    c->desc = mix(mix(mix(hash_str(op), a), b), d);
    c->checked = 0;
    atomic_store(&c->ctl[c->index].call_ring[c->call % CALL_RING],
                 ((uint64_t)c->call << 32) | (uint32_t)c->desc);
    return SHM_OK;
}

/* ------------------------------------------------------------------------------------------------ */
/* copies                                                                                            */

/* [Note: shm copies]
 * glibc's memcpy serves 8 KiB..(3/4 of L3) with `rep movsb`, which ran at ~10 GB/s on our 1 MiB chunks
 * where a plain AVX-512 loop reaches 20-27 GB/s; and for outputs that will not be re-read from cache
 * soon (> NT_MIN_BYTES in all) non-temporal stores skip the read-for-ownership (6.6 -> 9-11 GB/s at
 * 64 MiB). So chunk copies use our own loops when the CPU has AVX-512 (or AVX2 for the NT case). */

static int g_copy_isa = SHM_ISA_SCALAR; /* set by shm_best_isa() */

#if SHM_X86
__attribute__((target("avx512f"))) static void copy_avx512(char *dst, const char *src, size_t n, int nt) {
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t i = 0;
    if (nt) {
        for (; i + 256 <= n; i += 256) {
            __m512i a = _mm512_loadu_si512(src + i), b = _mm512_loadu_si512(src + i + 64);
            __m512i c = _mm512_loadu_si512(src + i + 128), d = _mm512_loadu_si512(src + i + 192);
            _mm512_stream_si512((void *)(dst + i), a), _mm512_stream_si512((void *)(dst + i + 64), b);
            _mm512_stream_si512((void *)(dst + i + 128), c), _mm512_stream_si512((void *)(dst + i + 192), d);
        }
        _mm_sfence();
    } else {
        for (; i + 256 <= n; i += 256) {
            __m512i a = _mm512_loadu_si512(src + i), b = _mm512_loadu_si512(src + i + 64);
            __m512i c = _mm512_loadu_si512(src + i + 128), d = _mm512_loadu_si512(src + i + 192);
            _mm512_store_si512((void *)(dst + i), a), _mm512_store_si512((void *)(dst + i + 64), b);
            _mm512_store_si512((void *)(dst + i + 128), c), _mm512_store_si512((void *)(dst + i + 192), d);
        }
    }
    memcpy(dst + i, src + i, n - i);
}

__attribute__((target("avx2"))) static void copy_nt_avx2(char *dst, const char *src, size_t n) {
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a), _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c), _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    memcpy(dst + i, src + i, n - i);
    _mm_sfence();
}
#endif

/* Copy n bytes; `nt` asks for non-temporal stores (big outputs only, see [Note: shm copies]). */
static void copy_bytes(void *dst, const void *src, size_t n, int nt) {
#if SHM_X86
    if (n >= 4096 && g_copy_isa == SHM_ISA_AVX512) {
        copy_avx512(dst, src, n, nt);
        return;
    }
    if (n >= 4096 && nt && g_copy_isa == SHM_ISA_AVX2) {
        copy_nt_avx2(dst, src, n);
        return;
    }
#endif
    (void)nt;
    memcpy(dst, src, n);
}

/* ------------------------------------------------------------------------------------------------ */
/* reduction kernels: fp32 accumulation in source order, one rounding (bit-exact with torch's casts)  */

/* dst[i] (and dst2[i] when dst2 != NULL) = round(sum_r srcs[r][i] (/ n)), for i in [begin, end). */
typedef void (*reduce_fn)(void *dst, void *dst2, const void *const *srcs, int n, size_t begin, size_t end,
                          int avg);

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float ld_f32(const void *p, size_t i) { return ((const float *)p)[i]; }
static inline void st_f32(void *p, size_t i, float v) { ((float *)p)[i] = v; }
static inline float ld_bf16(const void *p, size_t i) { return f32_from_bits((uint32_t)((const uint16_t *)p)[i] << 16); }
static inline void st_bf16(void *p, size_t i, float v) { /* c10::round_to_nearest_even */
    uint32_t u = f32_bits(v);
    ((uint16_t *)p)[i] = v != v ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float ld_f16(const void *p, size_t i) { /* c10 fp16_ieee_to_fp32_value */
    const uint32_t w = (uint32_t)((const uint16_t *)p)[i] << 16;
    const uint32_t sign = w & 0x80000000u, two_w = w + w;
    const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    return f32_from_bits(sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized)));
}
static inline void st_f16(void *p, size_t i, float f) { /* c10 fp16_ieee_from_fp32_value */
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    ((uint16_t *)p)[i] = (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

#define DEFINE_REDUCE_SCALAR(T)                                                                      \
    static void reduce_##T##_scalar(void *dst, void *dst2, const void *const *s, int n, size_t begin,  \
                                    size_t end, int avg) {                                          \
        const float fn = (float)n;                                                                  \
        for (size_t i = begin; i < end; i++) {                                                      \
            float acc = ld_##T(s[0], i);                                                            \
            for (int r = 1; r < n; r++) acc += ld_##T(s[r], i);                                     \
            if (avg) acc /= fn;                                                                     \
            st_##T(dst, i, acc);                                                                    \
            if (dst2 != NULL) st_##T(dst2, i, acc);                                                 \
        }                                                                                           \
    }
DEFINE_REDUCE_SCALAR(f32)
DEFINE_REDUCE_SCALAR(bf16)
DEFINE_REDUCE_SCALAR(f16)

#if SHM_X86
#define T256 __attribute__((target("avx2,f16c")))
#define T512 __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl")))
#define RNE_FLAGS (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

T256 static inline __m256 v8_ld_f32(const void *p, size_t i) { return _mm256_loadu_ps((const float *)p + i); }
T256 static inline void v8_st_f32(void *p, size_t i, __m256 v) { _mm256_storeu_ps((float *)p + i, v); }
T256 static inline __m256 v8_ld_bf16(const void *p, size_t i) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
T256 static inline void v8_st_bf16(void *p, size_t i, __m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
}
T256 static inline __m256 v8_ld_f16(const void *p, size_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}
T256 static inline void v8_st_f16(void *p, size_t i, __m256 v) {
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_cvtps_ph(v, RNE_FLAGS));
}

#define V8_STORE4(T, D, i, a0, a1, a2, a3)                                                            \
    v8_st_##T(D, i, a0), v8_st_##T(D, i + 8, a1), v8_st_##T(D, i + 16, a2), v8_st_##T(D, i + 24, a3)
#define DEFINE_REDUCE_AVX2(T)                                                                         \
    T256 static void reduce_##T##_avx2(void *dst, void *dst2, const void *const *s, int n, size_t begin, \
                                       size_t end, int avg) {                                         \
        const __m256 vn = _mm256_set1_ps((float)n);                                                   \
        size_t i = begin;                                                                             \
        for (; i + 32 <= end; i += 32) {                                                              \
            __m256 a0 = v8_ld_##T(s[0], i), a1 = v8_ld_##T(s[0], i + 8);                              \
            __m256 a2 = v8_ld_##T(s[0], i + 16), a3 = v8_ld_##T(s[0], i + 24);                        \
            for (int r = 1; r < n; r++) {                                                             \
                a0 = _mm256_add_ps(a0, v8_ld_##T(s[r], i));                                           \
                a1 = _mm256_add_ps(a1, v8_ld_##T(s[r], i + 8));                                       \
                a2 = _mm256_add_ps(a2, v8_ld_##T(s[r], i + 16));                                      \
                a3 = _mm256_add_ps(a3, v8_ld_##T(s[r], i + 24));                                      \
            }                                                                                         \
            if (avg) {                                                                                \
                a0 = _mm256_div_ps(a0, vn), a1 = _mm256_div_ps(a1, vn);                               \
                a2 = _mm256_div_ps(a2, vn), a3 = _mm256_div_ps(a3, vn);                               \
            }                                                                                         \
            V8_STORE4(T, dst, i, a0, a1, a2, a3);                                                     \
            if (dst2 != NULL) V8_STORE4(T, dst2, i, a0, a1, a2, a3);                                  \
        }                                                                                             \
        for (; i + 8 <= end; i += 8) {                                                                \
            __m256 a = v8_ld_##T(s[0], i);                                                            \
            for (int r = 1; r < n; r++) a = _mm256_add_ps(a, v8_ld_##T(s[r], i));                     \
            if (avg) a = _mm256_div_ps(a, vn);                                                        \
            v8_st_##T(dst, i, a);                                                                     \
            if (dst2 != NULL) v8_st_##T(dst2, i, a);                                                  \
        }                                                                                             \
        reduce_##T##_scalar(dst, dst2, s, n, i, end, avg);                                            \
    }
DEFINE_REDUCE_AVX2(f32)
DEFINE_REDUCE_AVX2(bf16)
DEFINE_REDUCE_AVX2(f16)

T512 static inline __m512 v16_ld_f32(const void *p, size_t i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}
T512 static inline void v16_st_f32(void *p, size_t i, __m512 v, __mmask16 m) {
    _mm512_mask_storeu_ps((float *)p + i, m, v);
}
T512 static inline __m512 v16_ld_bf16(const void *p, size_t i, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
T512 static inline void v16_st_bf16(void *p, size_t i, __m512 v, __mmask16 m) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)p + i, m, r);
}
T512 static inline __m512 v16_ld_f16(const void *p, size_t i, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
}
T512 static inline void v16_st_f16(void *p, size_t i, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16((uint16_t *)p + i, m, _mm512_cvtps_ph(v, RNE_FLAGS));
}

#define V16_STORE4(T, D, i, a0, a1, a2, a3, m)                                                         \
    v16_st_##T(D, i, a0, m), v16_st_##T(D, i + 16, a1, m), v16_st_##T(D, i + 32, a2, m),               \
        v16_st_##T(D, i + 48, a3, m)
#define DEFINE_REDUCE_AVX512(T)                                                                         \
    T512 static void reduce_##T##_avx512(void *dst, void *dst2, const void *const *s, int n, size_t begin, \
                                         size_t end, int avg) {                                         \
        const __m512 vn = _mm512_set1_ps((float)n);                                                     \
        const __mmask16 all = 0xFFFF;                                                                   \
        size_t i = begin;                                                                               \
        for (; i + 64 <= end; i += 64) {                                                                \
            __m512 a0 = v16_ld_##T(s[0], i, all), a1 = v16_ld_##T(s[0], i + 16, all);                   \
            __m512 a2 = v16_ld_##T(s[0], i + 32, all), a3 = v16_ld_##T(s[0], i + 48, all);              \
            for (int r = 1; r < n; r++) {                                                               \
                a0 = _mm512_add_ps(a0, v16_ld_##T(s[r], i, all));                                       \
                a1 = _mm512_add_ps(a1, v16_ld_##T(s[r], i + 16, all));                                  \
                a2 = _mm512_add_ps(a2, v16_ld_##T(s[r], i + 32, all));                                  \
                a3 = _mm512_add_ps(a3, v16_ld_##T(s[r], i + 48, all));                                  \
            }                                                                                           \
            if (avg) {                                                                                  \
                a0 = _mm512_div_ps(a0, vn), a1 = _mm512_div_ps(a1, vn);                                 \
                a2 = _mm512_div_ps(a2, vn), a3 = _mm512_div_ps(a3, vn);                                 \
            }                                                                                           \
            V16_STORE4(T, dst, i, a0, a1, a2, a3, all);                                                 \
            if (dst2 != NULL) V16_STORE4(T, dst2, i, a0, a1, a2, a3, all);                              \
        }                                                                                               \
        for (; i < end; i += 16) {                                                                      \
            __mmask16 m = end - i >= 16 ? all : (__mmask16)((1u << (end - i)) - 1u);                    \
            __m512 a = v16_ld_##T(s[0], i, m);                                                          \
            for (int r = 1; r < n; r++) a = _mm512_add_ps(a, v16_ld_##T(s[r], i, m));                   \
            if (avg) a = _mm512_div_ps(a, vn);                                                          \
            v16_st_##T(dst, i, a, m);                                                                   \
            if (dst2 != NULL) v16_st_##T(dst2, i, a, m);                                                \
        }                                                                                               \
    }
DEFINE_REDUCE_AVX512(f32)
DEFINE_REDUCE_AVX512(bf16)
DEFINE_REDUCE_AVX512(f16)
#endif

static const reduce_fn KERNELS[3][3] = {
    {reduce_f32_scalar, reduce_bf16_scalar, reduce_f16_scalar},
#if SHM_X86
    {reduce_f32_avx2, reduce_bf16_avx2, reduce_f16_avx2},
    {reduce_f32_avx512, reduce_bf16_avx512, reduce_f16_avx512},
#else
    {NULL, NULL, NULL},
    {NULL, NULL, NULL},
#endif
};
static const size_t ELEM_SIZE[3] = {4, 2, 2};

static int supported_isa(void) {
#if SHM_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        return SHM_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return SHM_ISA_AVX2;
#endif
    return SHM_ISA_SCALAR;
}

static int g_best_isa = -2;

SHM_API int shm_best_isa(void) {
    if (g_best_isa == -2) {
        int best = supported_isa();
        const char *env = getenv("SHARDPAR_SHM_ISA");
        if (env != NULL && strcmp(env, "scalar") == 0) best = SHM_ISA_SCALAR;
        if (env != NULL && strcmp(env, "avx2") == 0 && best > SHM_ISA_AVX2) best = SHM_ISA_AVX2;
        g_copy_isa = best;
        g_best_isa = best;
    }
    return g_best_isa;
}

SHM_API void shm_copy(void *dst, const void *src, uint64_t nbytes, int non_temporal) {
    shm_best_isa(); /* picks the copy routine */
    copy_bytes(dst, src, (size_t)nbytes, non_temporal);
}

SHM_API int shm_reduce(void *dst, const void *const *srcs, int nsrc, uint64_t count, int dtype, int op, int isa) {
    if (isa == SHM_ISA_BEST) isa = shm_best_isa();
    if (nsrc < 1 || dtype < 0 || dtype > 2 || (op != SHM_OP_SUM && op != SHM_OP_AVG) || isa < 0 ||
        isa > supported_isa())
        return SHM_EINVAL;
    KERNELS[isa][dtype](dst, NULL, srcs, nsrc, 0, (size_t)count, op == SHM_OP_AVG);
    return SHM_OK;
}

/* ------------------------------------------------------------------------------------------------ */
/* create / attach / destroy                                                                         */

static size_t data_offset_for(int nranks) {
    size_t head = sizeof(shm_header) + (size_t)nranks * sizeof(rank_ctl);
    return (head + PAGE - 1) / PAGE * PAGE;
}

static int map_segment(shm_comm *c, int fd) {
    void *p = mmap(NULL, c->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return fail(c, SHM_ESYS, "shm connect: mmap of %zu bytes failed: %s", c->map_bytes,
                                     strerror(errno));
    c->hdr = p;
    c->ctl = (rank_ctl *)((char *)p + sizeof(shm_header));
    c->data = (char *)p + data_offset_for(c->nranks);
    return SHM_OK;
}

/* "uid 65534 (nobody)" */
static void describe_uid(uid_t uid, char *out, size_t len) {
    struct passwd pw, *found = NULL;
    char buf[1024];
    if (getpwuid_r(uid, &pw, buf, sizeof(buf), &found) == 0 && found != NULL)
        snprintf(out, len, "uid %u (%s)", (unsigned)uid, found->pw_name);
    else
        snprintf(out, len, "uid %u", (unsigned)uid);
}

/* SHM_EFOREIGN naming the owner of the segment that holds our name (see [Note: shm trust]). */
static int refuse_foreign(shm_comm *c, const struct stat *sb, const char *what) {
    char owner[320], me[320];
    describe_uid(sb->st_uid, owner, sizeof(owner));
    describe_uid(geteuid(), me, sizeof(me));
    return fail(c, SHM_EFOREIGN, "shm connect: /dev/shm%s %s, owned by %s with mode %04o; this job runs as %s "
                "and only attaches segments it owns that grant nothing to group or others: refused, not attached "
                "and not removed (another user may be interfering with this job)", c->name, what, owner,
                (unsigned)(sb->st_mode & 07777), me);
}

/* Ours: a regular file of our effective uid that grants nothing to group or others. */
static int owned_by_us(const struct stat *sb) {
    return S_ISREG(sb->st_mode) && sb->st_uid == geteuid() && (sb->st_mode & 077) == 0;
}

/* The existing /dev/shm entry for our name (stat needs no permission on the file itself). */
static int stat_name(const shm_comm *c, struct stat *sb) {
    char path[300];
    snprintf(path, sizeof(path), "/dev/shm%s", c->name);
    return lstat(path, sb);
}

static int create_segment(shm_comm *c) {
    int fd = shm_open(c->name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST) {
        struct stat sb;
        if (stat_name(c, &sb) == 0 && !owned_by_us(&sb)) return refuse_foreign(c, &sb, "already exists");
        return fail(c, SHM_ESYS, "shm connect: /dev/shm%s already exists: another run of this user uses the same "
                    "key, or a crashed run left it (remove /dev/shm%s)", c->name, c->name);
    }
    if (fd < 0) return fail(c, SHM_ESYS, "shm connect: shm_open(%s) failed: %s", c->name, strerror(errno));
    if (fchmod(fd, 0600) != 0) { /* exactly 0600 whatever the umask took away: joiners need rw */
        int e = errno;
        close(fd);
        shm_unlink(c->name);
        return fail(c, SHM_ESYS, "shm connect: fchmod(%s, 0600) failed: %s", c->name, strerror(e));
    }
    if (ftruncate(fd, (off_t)c->map_bytes) != 0) {
        int e = errno;
        close(fd);
        shm_unlink(c->name);
        return fail(c, SHM_ESYS, "shm connect: ftruncate(%s, %zu) failed: %s", c->name, c->map_bytes, strerror(e));
    }
    int st = map_segment(c, fd);
    if (st != SHM_OK) {
        shm_unlink(c->name);
        return st;
    }
    shm_header *h = c->hdr;
    h->version = SHM_VERSION;
    h->nranks = (uint32_t)c->nranks;
    h->num_bufs = NUM_BUFS;
    h->chunk_bytes = c->chunk_bytes;
    h->total_bytes = c->map_bytes;
    h->data_offset = data_offset_for(c->nranks);
    atomic_store(&c->ctl[0].pidns, c->pidns);
    atomic_store(&c->ctl[0].cpu, sched_getcpu());
    atomic_store(&c->ctl[0].pid, (int32_t)getpid());
    atomic_store(&h->attached, 1);
    atomic_store(&h->magic, SHM_MAGIC); /* last: openers wait for it */
    if (c->nranks == 1) {
        shm_unlink(c->name);
        c->unlinked = 1;
    }
    return SHM_OK;
}

static int timed_out(shm_comm *c, long long deadline, int culprit, const char *why) {
    if (now_ns() < deadline) return 0;
    fail(c, SHM_ETIMEDOUT, "shm connect: rank %d (local index) did not arrive within %g s (%s)", culprit,
         c->timeout_s, why);
    return 1;
}

static int open_segment(shm_comm *c, long long deadline) {
    int fd;
    long long pause = 200000; /* 0.2 ms, backing off to 10 ms */
    struct stat sb;
    while ((fd = shm_open(c->name, O_RDWR | O_CLOEXEC, 0)) < 0) {
        int e = errno;
        if (e == EACCES && stat_name(c, &sb) == 0 && !owned_by_us(&sb))
            return refuse_foreign(c, &sb, "exists");
        if (e != ENOENT) return fail(c, SHM_ESYS, "shm connect: shm_open(%s): %s", c->name, strerror(e));
        if (timed_out(c, deadline, 0, "the segment was never created")) return SHM_ETIMEDOUT;
        sleep_ns(pause);
        pause = pause * 2 > 10000000 ? 10000000 : pause * 2;
    }
    /* Checked on the open descriptor, before anything is mapped: see [Note: shm trust]. */
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return fail(c, SHM_ESYS, "shm connect: fstat(%s): %s", c->name, strerror(e));
    }
    if (!owned_by_us(&sb)) {
        close(fd);
        return refuse_foreign(c, &sb, "exists");
    }
    while (fstat(fd, &sb) == 0 && (size_t)sb.st_size < c->map_bytes) {
        if (sb.st_size != 0 || timed_out(c, deadline, 0, "the segment was never sized")) {
            close(fd);
            if (sb.st_size != 0)
                return fail(c, SHM_EMISMATCH, "shm connect: %s has %lld bytes, expected %zu: ranks disagree on "
                            "the number of ranks or chunk_bytes", c->name, (long long)sb.st_size, c->map_bytes);
            return SHM_ETIMEDOUT;
        }
        sleep_ns(200000);
    }
    int st = map_segment(c, fd);
    if (st != SHM_OK) return st;
    while (atomic_load(&c->hdr->magic) != SHM_MAGIC) {
        if (timed_out(c, deadline, 0, "the segment was never initialised")) return SHM_ETIMEDOUT;
        sleep_ns(200000);
    }
    shm_header *h = c->hdr;
    if (h->version != SHM_VERSION || h->nranks != (uint32_t)c->nranks || h->chunk_bytes != c->chunk_bytes)
        return fail(c, SHM_EMISMATCH, "shm connect: %s was created for %u ranks, chunk_bytes %llu (version %u); "
                    "this rank expects %d ranks, chunk_bytes %llu", c->name, h->nranks,
                    (unsigned long long)h->chunk_bytes, h->version, c->nranks, (unsigned long long)c->chunk_bytes);
    int32_t none = 0;
    atomic_store(&c->ctl[c->index].pidns, c->pidns);
    atomic_store(&c->ctl[c->index].cpu, sched_getcpu());
    if (!atomic_compare_exchange_strong(&c->ctl[c->index].pid, &none, (int32_t)getpid()))
        return fail(c, SHM_EINVAL, "shm connect: local index %d already attached to %s (pid %d): duplicate index?",
                    c->index, c->name, (int)none);
    if (atomic_fetch_add(&h->attached, 1) + 1 == (uint32_t)c->nranks) {
        shm_unlink(c->name); /* everyone is in: see [Note: shm name lifetime] */
        c->unlinked = 1;
    }
    futex_wake_all(&h->attached);
    return SHM_OK;
}

static int wait_attached(shm_comm *c, long long deadline) {
    c->op = "connect";
    long long last_check = now_ns();
    for (;;) {
        uint32_t n = atomic_load(&c->hdr->attached);
        if (n == (uint32_t)c->nranks) return SHM_OK;
        uint64_t ab = atomic_load(&c->hdr->abort_word);
        if (ab != 0) return abort_status(c, ab);
        long long t = now_ns();
        if (t >= deadline) {
            int missing = 0;
            while (missing < c->nranks && atomic_load(&c->ctl[missing].pid) != 0) missing++;
            fail(c, SHM_ETIMEDOUT, "shm connect: rank %d (local index) did not arrive within %g s", missing,
                 c->timeout_s);
            return raise_abort(c, SHM_ETIMEDOUT, missing);
        }
        if (t - last_check >= LIVENESS_PERIOD_NS) {
            last_check = t;
            int st = check_liveness(c);
            if (st != SHM_OK) return st;
        }
        sleep_on(c, &c->hdr->attached, n, deadline - t < SLEEP_SLICE_NS ? deadline - t : SLEEP_SLICE_NS);
    }
}

static int online_cpus(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static int validate(shm_comm *c, const char *name, int index, int nranks, uint64_t chunk_bytes, double timeout_s) {
    if (name == NULL || name[0] != '/' || strchr(name + 1, '/') != NULL || strlen(name) >= sizeof(c->name) - 1)
        return fail(c, SHM_EINVAL, "shm connect: name %s must start with '/', have no other '/', and be < 255 chars",
                    name ? name : "(null)");
    if (nranks < 1 || nranks > SHM_MAX_RANKS || index < 0 || index >= nranks)
        return fail(c, SHM_EINVAL, "shm connect: need 0 <= index %d < nranks %d <= %d", index, nranks, SHM_MAX_RANKS);
    if (chunk_bytes < PAGE || chunk_bytes % PAGE != 0 || chunk_bytes > (1ull << 30) ||
        chunk_bytes / (uint64_t)nranks < PIECE_ALIGN)
        return fail(c, SHM_EINVAL, "shm connect: chunk_bytes %llu must be a multiple of %u in [%u, 2^30]",
                    (unsigned long long)chunk_bytes, PAGE, PAGE);
    if (!(timeout_s > 0 && timeout_s <= MAX_TIMEOUT_S))
        return fail(c, SHM_EINVAL, "shm connect: timeout_s %g must be in (0, %g]", timeout_s, MAX_TIMEOUT_S);
    return SHM_OK;
}

SHM_API shm_comm *shm_comm_create(const char *name, int index, int nranks, uint64_t chunk_bytes, double timeout_s,
                                  int *status, char *errbuf, size_t errlen) {
    shm_comm *c = calloc(1, sizeof(*c));
    int st = c == NULL ? SHM_ESYS : validate(c, name, index, nranks, chunk_bytes, timeout_s);
    if (st == SHM_OK) {
        snprintf(c->name, sizeof(c->name), "%s", name);
        c->index = index, c->nranks = nranks, c->chunk_bytes = chunk_bytes, c->timeout_s = timeout_s;
        c->map_bytes = data_offset_for(nranks) + (size_t)nranks * NUM_BUFS * chunk_bytes;
        /* Spin long only when every rank can own a core; otherwise yield the core to the peer we wait for. */
        c->spin_ns = c->auto_spin_ns = nranks <= online_cpus() ? 50000 : 1000;
        c->yield_ns = YIELD_NS;
        c->pidns = pid_namespace();
        c->owner = getpid();
        c->op = "connect";
        shm_best_isa();
        long long deadline = now_ns() + (long long)(timeout_s * 1e9);
        st = index == 0 ? create_segment(c) : open_segment(c, deadline);
        if (st == SHM_OK) st = wait_attached(c, deadline);
        if (st != SHM_OK && c->hdr != NULL && !c->unlinked) shm_unlink(c->name);
    }
    if (status != NULL) *status = st;
    if (st == SHM_OK) return c;
    if (errbuf != NULL && errlen > 0) snprintf(errbuf, errlen, "%s", c ? c->err : "shm connect: out of memory");
    shm_comm_destroy(c);
    return NULL;
}

SHM_API void shm_comm_destroy(shm_comm *c) {
    if (c == NULL) return;
    if (c->hdr != NULL) {
        if (getpid() == c->owner) { /* a fork()ed child only drops its copy of the mapping */
            atomic_store(&c->ctl[c->index].closed, 1);
            wake_everyone(c);
        }
        munmap(c->hdr, c->map_bytes);
    }
    free(c);
}

SHM_API const char *shm_comm_last_error(const shm_comm *c) { return c ? c->err : "null communicator"; }

SHM_API int shm_comm_set_wait(shm_comm *c, int patient) {
    c->spin_ns = patient ? 0 : c->auto_spin_ns;
    c->yield_ns = patient ? 0 : YIELD_NS;
    return SHM_OK;
}

SHM_API int shm_comm_set_timeout(shm_comm *c, double timeout_s) {
    if (!(timeout_s > 0 && timeout_s <= MAX_TIMEOUT_S))
        return fail(c, SHM_EINVAL, "shm: timeout_s %g must be in (0, %g]", timeout_s, MAX_TIMEOUT_S);
    c->timeout_s = timeout_s;
    return SHM_OK;
}

/* ------------------------------------------------------------------------------------------------ */
/* collectives                                                                                       */

/* AllGather: each rank writes chunk s of its input into its slot; everyone copies every slot out.
 *   step s:  in[s*C .. +C) -> slot[me][b]  publish W  |  slot[j][b] -> out[j*nbytes + s*C ..]  publish R */
SHM_API int shm_comm_all_gather(shm_comm *c, void *out, const void *in, uint64_t nbytes) {
    int st = begin_call(c, "all_gather", nbytes, 0, 0);
    if (st != SHM_OK || nbytes == 0) return st;
    const int n = c->nranks, me = c->index, nt = (uint64_t)n * nbytes >= NT_MIN_BYTES;
    char *o = out;
    const char *src = in;
    for (uint64_t off = 0; off < nbytes; off += c->chunk_bytes) {
        size_t len = nbytes - off < c->chunk_bytes ? (size_t)(nbytes - off) : (size_t)c->chunk_bytes;
        uint32_t b;
        if ((st = acquire_buf(c, &b)) != SHM_OK) return st;
        copy_bytes(slot(c, me, b), src + off, len, 0);
        publish(c, 1);
        const uint32_t written = c->seq;
        if (o + (size_t)me * nbytes != src) copy_bytes(o + (size_t)me * nbytes + off, src + off, len, nt);
        for (int k = 1; k < n; k++) {
            int j = (me + k) % n;
            if ((st = wait_peer(c, j, written)) != SHM_OK) return st;
            copy_bytes(o + (size_t)j * nbytes + off, slot(c, j, b), len, nt);
        }
        publish(c, 1);
        c->free_seq[b] = c->seq;
    }
    return SHM_OK;
}

static int check_reduce_args(shm_comm *c, int dtype, int op) {
    if (dtype < 0 || dtype > 2) return fail(c, SHM_EINVAL, "shm %s: unknown dtype code %d", c->op, dtype);
    if (op != SHM_OP_SUM && op != SHM_OP_AVG) return fail(c, SHM_EINVAL, "shm %s: unknown op code %d", c->op, op);
    return SHM_OK;
}

/* Elements per piece when a slot is cut into n pieces (one per destination rank), 64-byte aligned. */
static size_t piece_elems(const shm_comm *c, size_t esz) {
    return (size_t)(c->chunk_bytes / (uint64_t)c->nranks / PIECE_ALIGN * PIECE_ALIGN) / esz;
}

/* [Note: shm spans]
 * A ReduceScatter input may be given as a list of spans -- (pointer, count), or zeros when the pointer is
 * NULL -- that together form the [nranks * count] input. The reducer passes each parameter's gradient
 * where autograd left it, so no model-sized bucket is allocated (fresh mmap pages: ~70 ms per 105 MB
 * here) and packed only to be read once (docs/performance-history.md, item 7). Reads go forward only, so a
 * cursor per destination block walks the list once per call. A contiguous input is a list of one. */
_Static_assert(sizeof(shm_span) == 16, "shm.py passes spans as pairs of uint64");

typedef struct {
    uint64_t i, start; /* span i begins at logical element `start` */
} cursor;

static void seek(const shm_span *p, uint64_t np, cursor *cur, uint64_t at) {
    while (cur->i < np && cur->start + p[cur->i].count <= at) cur->start += p[cur->i++].count;
}

/* dst <- logical elements [at, at + len) of the spans (zeros for NULL spans). */
static void read_spans(const shm_span *p, uint64_t np, cursor *cur, size_t esz, char *dst, uint64_t at,
                        size_t len) {
    seek(p, np, cur, at);
    for (cursor k = *cur; len > 0; k.start += p[k.i++].count) {
        uint64_t skip = at - k.start;
        size_t take = p[k.i].count - skip < len ? (size_t)(p[k.i].count - skip) : len;
        if (p[k.i].ptr) copy_bytes(dst, (const char *)p[k.i].ptr + skip * esz, take * esz, 0);
        else memset(dst, 0, take * esz);
        dst += take * esz, at += take, len -= take;
    }
}

/* A pointer to logical elements [at, at + len) when they lie inside one non-NULL span, else NULL. */
static const char *read_direct(const shm_span *p, uint64_t np, cursor *cur, size_t esz, uint64_t at, size_t len) {
    seek(p, np, cur, at);
    if (cur->i >= np || !p[cur->i].ptr || at + len > cur->start + p[cur->i].count) return NULL;
    return (const char *)p[cur->i].ptr + (at - cur->start) * esz;
}

/* ReduceScatter: my slot holds, per step, piece j = chunk s of in's block j for every j != me; I reduce
 * block `me` alone (1/n of the work) from my own input and piece `me` of every peer's slot, in rank order.
 *   slot[me][b]:  | piece 0 | piece 1 | ... | piece n-1 |     piece j -> read by rank j only
 * My own block is read in place; only where it crosses spans (or zeros) is it assembled first, into the
 * piece `me` of my slot, which no peer reads. */
static int reduce_scatter(shm_comm *c, void *out, const shm_span *in, uint64_t np, uint64_t count, int dtype,
                          int op) {
    int st = begin_call(c, "reduce_scatter", count, (uint64_t)dtype, (uint64_t)op);
    if (st == SHM_OK) st = check_reduce_args(c, dtype, op);
    if (st != SHM_OK || count == 0) return st;
    const int n = c->nranks, me = c->index;
    const size_t esz = ELEM_SIZE[dtype], P = piece_elems(c, esz);
    const reduce_fn kernel = KERNELS[shm_best_isa()][dtype];
    const void *srcs[SHM_MAX_RANKS];
    cursor cur[SHM_MAX_RANKS] = {{0, 0}};
    for (uint64_t off = 0; off < count; off += P) {
        size_t len = count - off < P ? (size_t)(count - off) : P;
        uint32_t b;
        if ((st = acquire_buf(c, &b)) != SHM_OK) return st;
        for (int j = 0; j < n; j++)
            if (j != me) read_spans(in, np, &cur[j], esz, slot(c, me, b) + (size_t)j * P * esz, j * count + off, len);
        publish(c, 1);
        const char *mine = read_direct(in, np, &cur[me], esz, me * count + off, len);
        if (!mine) {
            mine = slot(c, me, b) + (size_t)me * P * esz;
            read_spans(in, np, &cur[me], esz, (char *)mine, me * count + off, len);
        }
        if ((st = wait_all(c, c->seq)) != SHM_OK) return st;
        for (int r = 0; r < n; r++) srcs[r] = r == me ? mine : slot(c, r, b) + (size_t)me * P * esz;
        kernel((char *)out + off * esz, NULL, srcs, n, 0, len, op == SHM_OP_AVG);
        publish(c, 1);
        c->free_seq[b] = c->seq;
    }
    return SHM_OK;
}

SHM_API int shm_comm_reduce_scatter(shm_comm *c, void *out, const void *in, uint64_t count, int dtype, int op) {
    if (in == NULL && count > 0) return fail(c, SHM_EINVAL, "shm reduce_scatter: input is NULL");
    const shm_span whole = {in, (uint64_t)c->nranks * count};
    return reduce_scatter(c, out, &whole, 1, count, dtype, op);
}

SHM_API int shm_comm_reduce_scatter_spans(shm_comm *c, void *out, const shm_span *spans, uint64_t nspans,
                                           uint64_t count, int dtype, int op) {
    uint64_t total = 0;
    for (uint64_t i = 0; i < nspans; i++) total += spans[i].count;
    /* Checked before begin_call, so this communicator stays usable (the call count does not move); the
     * peers, already inside the call, still wait for this rank until their timeout. Python checks first. */
    if (total != (uint64_t)c->nranks * count)
        return fail(c, SHM_EINVAL, "shm reduce_scatter: the spans hold %llu elements, not %d x %llu",
                    (unsigned long long)total, c->nranks, (unsigned long long)count);
    return reduce_scatter(c, out, spans, nspans, count, dtype, op);
}

/* One-phase AllReduce for small messages: every rank reduces the whole chunk from all slots; n x the
 * arithmetic, but two syncs per step instead of three, which is what small messages pay for.
 * Same summation order as the two-phase algorithm, so the same bits. */
static int all_reduce_one_phase(shm_comm *c, char *buf, uint64_t count, size_t esz, reduce_fn kernel, int avg) {
    const int n = c->nranks, me = c->index;
    const size_t per_step = (size_t)c->chunk_bytes / esz;
    const void *srcs[SHM_MAX_RANKS];
    int st;
    for (uint64_t off = 0; off < count; off += per_step) {
        size_t len = count - off < per_step ? (size_t)(count - off) : per_step;
        uint32_t b;
        if ((st = acquire_buf(c, &b)) != SHM_OK) return st;
        copy_bytes(slot(c, me, b), buf + off * esz, len * esz, 0);
        publish(c, 1);
        if ((st = wait_all(c, c->seq)) != SHM_OK) return st;
        for (int r = 0; r < n; r++) srcs[r] = slot(c, r, b);
        kernel(buf + off * esz, NULL, srcs, n, 0, len, avg);
        publish(c, 1);
        c->free_seq[b] = c->seq;
    }
    return SHM_OK;
}

/* AllReduce = ReduceScatter + AllGather through the same slot, per step of n*P elements cut in n pieces:
 *   1. pieces j != me of the step -> slot[me][b] piece j                          publish W
 *   2. reduce piece me: my buf + piece me of every peer's slot -> slot[me][b] piece me and my buf
 *                                                                                   publish D
 *   3. piece j of slot[j][b] -> buf, for every j != me                             publish R
 * Per element a rank copies (n-1)/n in and (n-1)/n out and reduces 1/n. The alternatives we measured move
 * more: copying the whole step in (4.2 ms at 16 MiB, 2 ranks, vs 3.0 for the one-phase algorithm), and the
 * one-phase algorithm itself, which this one matched or beat at 1-64 MiB with 2 ranks (A/B in the same
 * processes: 13.4 vs 14.1 ms at 16 MiB, 75 vs 95 ms at 64 MiB, on a heavily loaded machine). */
static int all_reduce_two_phase(shm_comm *c, char *data, uint64_t count, size_t esz, reduce_fn kernel, int avg) {
    const int n = c->nranks, me = c->index, nt = count * esz >= NT_MIN_BYTES;
    const size_t P = piece_elems(c, esz), S = P * (size_t)n;
    const void *srcs[SHM_MAX_RANKS];
    int st;
    for (uint64_t base = 0; base < count; base += S) {
        size_t total = count - base < S ? (size_t)(count - base) : S, lo[SHM_MAX_RANKS], hi[SHM_MAX_RANKS];
        for (int j = 0; j < n; j++) {
            lo[j] = (size_t)j * P < total ? (size_t)j * P : total;
            hi[j] = lo[j] + P < total ? lo[j] + P : total;
        }
        uint32_t b;
        if ((st = acquire_buf(c, &b)) != SHM_OK) return st;
        char *mine = slot(c, me, b), *chunk = data + base * esz;
        for (int j = 0; j < n; j++)
            if (j != me) copy_bytes(mine + lo[j] * esz, chunk + lo[j] * esz, (hi[j] - lo[j]) * esz, 0);
        publish(c, 1);
        if (hi[me] > lo[me]) {
            if ((st = wait_all(c, c->seq)) != SHM_OK) return st;
            for (int r = 0; r < n; r++) srcs[r] = r == me ? chunk + lo[me] * esz : slot(c, r, b) + lo[me] * esz;
            kernel(mine + lo[me] * esz, chunk + lo[me] * esz, srcs, n, 0, hi[me] - lo[me], avg);
        }
        publish(c, 1);
        const uint32_t reduced = c->seq;
        for (int k = 1; k < n; k++) {
            int j = (me + k) % n;
            if (hi[j] == lo[j]) continue;
            if ((st = wait_peer(c, j, reduced)) != SHM_OK) return st;
            copy_bytes(chunk + lo[j] * esz, slot(c, j, b) + lo[j] * esz, (hi[j] - lo[j]) * esz, nt);
        }
        publish(c, 1);
        c->free_seq[b] = c->seq;
    }
    return SHM_OK;
}

SHM_API int shm_comm_all_reduce(shm_comm *c, void *buf, uint64_t count, int dtype, int op) {
    int st = begin_call(c, "all_reduce", count, (uint64_t)dtype, (uint64_t)op);
    if (st == SHM_OK) st = check_reduce_args(c, dtype, op);
    if (st != SHM_OK || count == 0) return st;
    const size_t esz = ELEM_SIZE[dtype];
    const reduce_fn kernel = KERNELS[shm_best_isa()][dtype];
    if (c->nranks == 1 || count * esz <= SMALL_ALLREDUCE_BYTES)
        return all_reduce_one_phase(c, buf, count, esz, kernel, op == SHM_OP_AVG);
    return all_reduce_two_phase(c, buf, count, esz, kernel, op == SHM_OP_AVG);
}

/* Broadcast: the root writes chunk s into its slot, the others copy it out. Counters still advance by
 * two per step on every rank (W, R) so that they stay in lock-step for the next collective. */
SHM_API int shm_comm_broadcast(shm_comm *c, void *buf, uint64_t nbytes, int root) {
    int st = begin_call(c, "broadcast", nbytes, (uint64_t)root, 0);
    if (st == SHM_OK && (root < 0 || root >= c->nranks))
        st = fail(c, SHM_EINVAL, "shm broadcast: root %d is not a local index in [0, %d)", root, c->nranks);
    if (st != SHM_OK || nbytes == 0) return st;
    char *data = buf;
    const int nt = nbytes >= NT_MIN_BYTES;
    for (uint64_t off = 0; off < nbytes; off += c->chunk_bytes) {
        size_t len = nbytes - off < c->chunk_bytes ? (size_t)(nbytes - off) : (size_t)c->chunk_bytes;
        uint32_t b;
        if (c->index == root) {
            if ((st = acquire_buf(c, &b)) != SHM_OK) return st;
            copy_bytes(slot(c, root, b), data + off, len, 0);
            publish(c, 2);
            c->free_seq[b] = c->seq;
        } else {
            b = c->step++ % NUM_BUFS;
            if ((st = wait_peer(c, root, c->seq + 1)) != SHM_OK) return st;
            copy_bytes(data + off, slot(c, root, b), len, nt);
            publish(c, 2);
        }
    }
    return SHM_OK;
}

SHM_API int shm_comm_barrier(shm_comm *c) {
    int st = begin_call(c, "barrier", 0, 0, 0);
    if (st != SHM_OK) return st;
    publish(c, 1);
    return wait_all(c, c->seq);
}
