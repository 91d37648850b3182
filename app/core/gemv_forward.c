/* One-row products as matrix-vector products.

   MLX's CPU backend sends every float32 matmul to cblas_sgemm, a decode step's too: one
   token is a 1 x K row times a K x N weight. OpenBLAS on x86-64 runs such a call as a
   full GEMM, which first copies ("packs") the whole weight into a scratch buffer, so a
   memory-bound step reads every weight twice and writes it once. Its GEMM_GEMV_FORWARD
   build option hands these calls to sgemv instead, but it is only on for ARM64, POWER
   and RISC-V builds.

   Preloaded ahead of the BLAS (app/core/blas.py), this library's cblas_sgemm does that
   forwarding for row-major calls with M == 1 or N == 1 and passes every other call to
   the next library's cblas_sgemm. The result is the same product, summed in another
   order; as with GEMM, beta == 0 means C is not read (BLAS's rule for GEMV's y too). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;

/* 1 while calls are forwarded: a benchmark may clear it to time plain GEMM in-process */
int kvchat_gemv_forward = 1;
/* calls forwarded so far (tests read it to see the path was taken) */
long kvchat_gemv_calls = 0;

static void resolve(void) {
  /* the same values from every thread: a race only repeats the lookup */
  next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
  next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C,
                 int ldc) {
  if (next_sgemm == NULL) resolve();
  if (kvchat_gemv_forward && next_sgemv != NULL && order == ROW_MAJOR && K > 0 &&
      (M == 1 || N == 1)) {
    __atomic_fetch_add(&kvchat_gemv_calls, 1, __ATOMIC_RELAXED);
    if (M == 1) {
      /* C (1 x N) = a (1 x K) . op(B) (K x N), i.e. c = op(B)^T a */
      int inc_a = trans_a == NO_TRANS ? 1 : lda;
      if (trans_b == NO_TRANS) /* B is K x N */
        next_sgemv(ROW_MAJOR, TRANS, K, N, alpha, B, ldb, A, inc_a, beta, C, 1);
      else /* B is N x K */
        next_sgemv(ROW_MAJOR, NO_TRANS, N, K, alpha, B, ldb, A, inc_a, beta, C, 1);
    } else {
      /* C (M x 1) = op(A) (M x K) . b (K x 1) */
      int inc_b = trans_b == NO_TRANS ? ldb : 1;
      if (trans_a == NO_TRANS) /* A is M x K */
        next_sgemv(ROW_MAJOR, NO_TRANS, M, K, alpha, A, lda, B, inc_b, beta, C, ldc);
      else /* A is K x M */
        next_sgemv(ROW_MAJOR, TRANS, K, M, alpha, A, lda, B, inc_b, beta, C, ldc);
    }
    return;
  }
  next_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
