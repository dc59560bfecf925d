/* shardpar shared-memory intra-node transport: the C ABI that shardpar/collectives/shm.py loads with ctypes.
 *
 * One communicator per process per group of local ranks ("local index" 0..nranks-1). Every call is
 * synchronous and returns a status (0 = ok, < 0 = error); shm_comm_last_error() gives the message.
 * After a timeout, a dead peer or a mismatch the communicator is aborted: every rank's later calls fail.
 * A communicator is used by one thread at a time (the caller serialises). It belongs to the process that
 * created it: in a fork()ed child every call fails with SHM_EINVAL and destroy only unmaps.
 * SHARDPAR_SHM_ISA=scalar|avx2 in the environment caps the kernels picked at run time (for testing).
 */
#ifndef SHARDPAR_SHM_TRANSPORT_H
#define SHARDPAR_SHM_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHM_OK 0
#define SHM_EINVAL (-1)     /* bad argument (caller bug)                                  */
#define SHM_ESYS (-2)       /* a system call failed (message carries strerror)            */
#define SHM_ETIMEDOUT (-3)  /* a peer did not arrive within the timeout (message names it) */
#define SHM_EPEERDEAD (-4)  /* a peer process died (message names it)                     */
#define SHM_EPEERGONE (-5)  /* a peer closed its communicator while others still waited   */
#define SHM_EMISMATCH (-6)  /* ranks called different collectives / sizes / parameters    */
#define SHM_EFOREIGN (-7)   /* the segment's name is taken by a segment that is not ours   */

#define SHM_DTYPE_F32 0
#define SHM_DTYPE_BF16 1
#define SHM_DTYPE_F16 2

#define SHM_OP_SUM 0
#define SHM_OP_AVG 1

#define SHM_ISA_BEST (-1)
#define SHM_ISA_SCALAR 0
#define SHM_ISA_AVX2 1
#define SHM_ISA_AVX512 2

typedef struct shm_comm shm_comm;

/* `name` is the POSIX shm name ("/shardpar-<key>-<group>"); index 0 creates it (O_EXCL, mode 0600), the
 * others open it (retrying until `timeout_s`) and attach only when it belongs to this process's
 * effective uid and has no group/other permission bits (SHM_EFOREIGN otherwise, naming the owner and
 * the path; a foreign segment is never mapped nor unlinked). It is unlinked as soon as all ranks
 * attached. See [Note: shm trust] in shm_transport.c.
 * On failure returns NULL, writes the message to errbuf and the status to *status. */
shm_comm *shm_comm_create(const char *name, int index, int nranks, uint64_t chunk_bytes, double timeout_s,
                          int *status, char *errbuf, size_t errlen);
void shm_comm_destroy(shm_comm *comm);
const char *shm_comm_last_error(const shm_comm *comm);
int shm_comm_set_timeout(shm_comm *comm, double timeout_s);
/* patient = 1: waits sleep on a futex at once instead of spinning and yielding first (for collectives
 * that run beside the process's own compute); 0: the default, picked from ranks vs cores. */
int shm_comm_set_wait(shm_comm *comm, int patient);

/* out[nranks * nbytes] <- concatenation of every rank's in[nbytes] (in may be out's own block). */
int shm_comm_all_gather(shm_comm *comm, void *out, const void *in, uint64_t nbytes);
/* out[count] <- reduction over ranks of block `index` of in[nranks * count]. */
int shm_comm_reduce_scatter(shm_comm *comm, void *out, const void *in, uint64_t count, int dtype, int op);
/* The same, with the input given as spans laid end to end (ptr NULL = `count` zeros); their counts must
 * add up to nranks * count. The spans are read in place (see [Note: shm spans]). */
typedef struct {
    const void *ptr;
    uint64_t count;
} shm_span;
int shm_comm_reduce_scatter_spans(shm_comm *comm, void *out, const shm_span *spans, uint64_t nspans,
                                   uint64_t count, int dtype, int op);
/* buf[count] <- reduction over ranks of buf[count], in place. */
int shm_comm_all_reduce(shm_comm *comm, void *buf, uint64_t count, int dtype, int op);
/* buf[nbytes] <- root's buf[nbytes]. */
int shm_comm_broadcast(shm_comm *comm, void *buf, uint64_t nbytes, int root);
int shm_comm_barrier(shm_comm *comm);

/* The reduction kernel on its own (for tests): dst[i] = round(sum_r srcs[r][i] (/ nsrc for avg)),
 * summed in fp32 in source order. isa: SHM_ISA_*; SHM_EINVAL when that ISA is not available. */
int shm_reduce(void *dst, const void *const *srcs, int nsrc, uint64_t count, int dtype, int op, int isa);
/* The best ISA this CPU supports (SHM_ISA_*), after the SHARDPAR_SHM_ISA override. */
int shm_best_isa(void);

/* dst = src (nbytes, no overlap) with the transport's own copy routine; non_temporal streams the stores
 * past the cache as the collectives do for large outputs. For benchmarks: the floor a collective's
 * copies cannot beat. */
void shm_copy(void *dst, const void *src, uint64_t nbytes, int non_temporal);

#ifdef __cplusplus
}
#endif
#endif
