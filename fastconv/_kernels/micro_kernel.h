/* The GEMM micro-kernel, one source for every ISA build.
 *
 * acc[R*NR] = A (R rows read in place) @ B_panel (packed: NR values per
 * k), accumulated in R x (NR/VL) vector registers.
 *
 * Written with GCC/Clang vector extensions rather than plain loops: the
 * compiler's auto-vectoriser picks a good schedule for some (MR, NR) and a
 * catastrophically bad one for others (measured: 14x32 on AVX-512 ran at
 * ~95% of peak, 6x16 on AVX2 at 3%).  Explicit vectors plus full unrolling
 * give every build register-resident accumulators, whatever the ISA.
 *
 * The including module defines, before this header:
 *   FC_VBYTES            vector width in bytes (64 AVX-512, 32 AVX2, 16 baseline)
 *   FC_S_MR, FC_S_NR     float32 tile, FC_S_NR a multiple of FC_VBYTES/4
 *   FC_D_MR, FC_D_NR     float64 tile, FC_D_NR a multiple of FC_VBYTES/8
 */
#ifndef FASTCONV_MICRO_KERNEL_H
#define FASTCONV_MICRO_KERNEL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if !defined(__GNUC__)
#error "fastconv's micro-kernel needs GCC or Clang vector extensions"
#endif

#define FC_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define FC_UNROLL FC_PRAGMA(clang loop unroll(full))
#define FC_UNROLL_2 FC_PRAGMA(clang loop unroll_count(2))
#else
#define FC_UNROLL FC_PRAGMA(GCC unroll 64)
#define FC_UNROLL_2 FC_PRAGMA(GCC unroll 2)
#endif

/* out = A (R x K) @ B_panel (K x NR), finished in registers.  A's rows are
 * read in place: nruns runs of kc contiguous values each, or, for A.T
 * views, R contiguous values a k (the second kind below).
 *
 * - A plain GEMM (fc_micro_kernel) has one run: row-major A, rows rsa
 *   apart.  Packing a row-major A into k-major panels would be a transpose
 *   that cost 6-20 % on conv-shaped products, while these in-place reads
 *   run as fast.
 * - An A.T view (fc_kmajor_kernel: a weight gradient's dy^T, whose R
 *   values of each k are contiguous, lda values apart from one k to the
 *   next) is read where it lies too.  Copying each R x kc slice into a
 *   k-major panel first (as BLIS packs A) read a line or two of each of kc
 *   rows to keep 48 bytes of them, and those loads stalled: on Zen 5, 1
 *   thread, the copies took 26 % of a 1x1 weight gradient (dy^T @ x,
 *   256 x 25088 by 25088 x 64), which ran 146-152 GFLOPS that way and
 *   186-198 in place (256 x 128: 192 -> 220; 1024^3 217 -> 245; 2048 x 64
 *   x 3136 146 -> 230; 64 x 2048 x 3136, 64 panels a slice, 153-157
 *   either way).  Its B panel steps ldb values a k: NR when packed, B's
 *   row stride when a narrow B is read in place too (see gemm_nogil).
 *   pfa, pfb: when not 0, each k step prefetches the tile's values of A
 *   pfa bytes on (some k ahead), and of a B read in place pfb bytes on,
 *   for operands streamed from memory (see macro_kernel_ld).
 * - An implicit-GEMM convolution (fc_shared_runs_kernel) has one run per
 *   kernel tap or kernel row, at the same offsets for every pixel: run t
 *   of row i starts at pix[i] + run_off[t].  Each of the R output pixels
 *   points into the image where its taps are inside, or into its shadow
 *   window, a copy of its taps laid out at the image's offsets, where some
 *   tap falls in the padding; so any R consecutive pixels make a tile,
 *   across output rows and image borders alike (tiles cut at row ends and
 *   borders ran 1+12+12+3 pixels for a 28-wide row, and a strided 3x3
 *   layer spent ~15 % of its time in the short ones).  A table of every
 *   run's pointer, built per tile (what patch rows needed), cost 3-14 %
 *   of layers with short runs (VGG conv1_1 at batch 8: 9-value runs).
 *
 * The R x NR result goes to out (rows rso apart): added to what is there
 * (FC_OUT_ADD), plus bias[0:NR] when bias is given, clamped by act (1 relu,
 * 2 relu6; masks, so NaN stays NaN), with non-temporal stores when
 * FC_OUT_STREAM (out and rso vector-aligned).  Straight from the
 * accumulators: storing them to a stack tile for the frame to add to C
 * cost ~4 % of a K = 27 product (VGG conv1_1, 1 thread), ~1 % at K = 64
 * (1x1 64->256), where C's own traffic dominates the epilogue.  A
 * frame with a tile it cannot finish so (partial width, alpha != 1, beta
 * other than 0 and 1, strided C) passes a stack tile (out = acc, rso = NR,
 * no flags) and finishes it.
 *
 * The plain kernel takes pf: when not 0, it prefetches (into L2) each of
 * its rows pf bytes on as it walks k, one line per row every 64 bytes (the
 * GEMM frame's next A slice; see macro_kernel_ld).  It is kept out of line:
 * inlined into the frame's clones it ran 3-4 % slower on a 1x1 64->256
 * layer (2 threads).
 *
 * One kernel per row count R = 1..16, so a short last panel of A (M = 49 =
 * 4*12 + 1) costs R rows of work instead of MR; the dispatchers below pick
 * one.  Kernels with R above the build's MR are never called.  The
 * implicit GEMM also has a paired-panel kernel (FC_S_PAIR_MR rows x 2 NR:
 * two adjacent packed panels at once) for builds that define it.
 *
 * ROW(t, i) points at the first value of run t of row i; at the start of
 * each run the kernel turns the R pointers into byte offsets from row 0's
 * (see the loop). */
enum { FC_OUT_ADD = 1, FC_OUT_STREAM = 2 };

/* One k of FC_KERNEL_BODY: the R x NR rank-1 update from row values at
 * a + off[i] and the panel's NR values at b, then both step on. */
#define FC_K_STEP(T, MR, NR, KSTEP, BSTEP)                                      \
    {                                                                           \
        VEC bv[NV];                                                             \
        /* memcpy: an unaligned-safe vector load the compiler folds.  The    \
           vectors past the panel's NR come from the paired panel b2. */      \
        FC_UNROLL for (int j = 0; j < NV; j++)                                  \
            memcpy(&bv[j], j < NVP ? b + j * VL : b2 + (j - NVP) * VL,          \
                   FC_VBYTES);                                                  \
        FC_UNROLL for (int i = 0; i < (MR); i++) {                              \
            T ai;                                                               \
            memcpy(&ai, a + off[i], sizeof(T));                                 \
            FC_UNROLL for (int j = 0; j < NV; j++)                              \
                c[i][j] += ai * bv[j];                                          \
        }                                                                       \
        a += (KSTEP);                                                           \
        b += (BSTEP);                                                           \
        b2 += (BSTEP);                                                          \
    }

#define FC_KERNEL_BODY(SUFFIX, T, MR, NR, NRUNS, ROW, KSTEP, PF)               \
    FC_KERNEL_BODY_PANELS(SUFFIX, T, MR, NR, 1, NRUNS, ROW, KSTEP, NR, PF, b, 0, 0)

/* PANELS 1: the R x NR tile of the panel at b; 2: the R x 2NR tile of the
 * panels at b and b2 side by side (out's columns NR.. are b2's).  BSTEP:
 * values from one k of the panel to the next (NR packed; B's row stride
 * for a panel read in place, see fc_kmajor_kernel). */
#define FC_KERNEL_BODY_PANELS(SUFFIX, T, MR, NR, PANELS, NRUNS, ROW, KSTEP,     \
                              BSTEP, PF, B2, KPFA, KPFB)                        \
    {                                                                           \
        typedef fc_vec_##SUFFIX VEC;                                            \
        typedef fc_ivec_##SUFFIX IVEC;                                          \
        enum { VL = FC_VBYTES / sizeof(T), NVP = (NR) / VL,                     \
               NV = NVP * (PANELS) };                                           \
        const T *b2 = (B2);                                                     \
        VEC c[MR][NV];                                                          \
        FC_UNROLL for (int i = 0; i < (MR); i++)                                \
            FC_UNROLL for (int j = 0; j < NV; j++)                              \
                c[i][j] = (VEC){0};                                             \
        for (ptrdiff_t t = 0; t < (NRUNS); t++) {                               \
            /* Row i as a byte offset from row 0, which steps through k:   \
               base + offset addressing, as GCC gives plain row-major A     \
               (indexing each row pointer by k, base + 4*k, ran ~5 %      \
               slower on Zen 4). */                                          \
            const char *a = (const char *)(ROW(t, 0));                          \
            ptrdiff_t off[MR];                                                  \
            FC_UNROLL for (int i = 0; i < (MR); i++)                            \
                off[i] = (ptrdiff_t)((uintptr_t)(ROW(t, i)) - (uintptr_t)a);    \
            if (PF)                                                             \
                /* k a line (64 bytes) of a row at a time, each step asking  \
                   for the line of each row PF bytes on; a loop of its own,  \
                   so that calls without PF keep the plain one. */           \
                for (ptrdiff_t p0 = 0; p0 < kc; p0 += 64 / sizeof(T)) {         \
                    ptrdiff_t pn = kc - p0 < (ptrdiff_t)(64 / sizeof(T))        \
                                   ? kc - p0 : (ptrdiff_t)(64 / sizeof(T));     \
                    FC_UNROLL for (int i = 0; i < (MR); i++)                    \
                        __builtin_prefetch(a + off[i] + (PF), 0, 2);            \
                    for (ptrdiff_t p = 0; p < pn; p++)                          \
                        FC_K_STEP(T, MR, NR, KSTEP, BSTEP)                      \
                }                                                               \
            else if (KPFA)                                                      \
                /* A k-major A's (and a B read in place) values KPFA (KPFB)  \
                   bytes on, that is some k ahead, asked for at each k: the \
                   lines of MR values (and of the panel's NR). */            \
                FC_UNROLL_2                                                     \
                for (ptrdiff_t p = 0; p < kc; p++) {                            \
                    FC_UNROLL for (int l = 0; l < (int)((MR) * sizeof(T)); l += 64) \
                        __builtin_prefetch(a + (KPFA) + l, 0, 3);               \
                    __builtin_prefetch(a + (KPFA) + ((MR) - 1) * sizeof(T), 0, 3); \
                    if (KPFB)                                                   \
                        FC_UNROLL for (int l = 0; l < (int)((NR) * sizeof(T)); l += 64) \
                            __builtin_prefetch((const char *)b + (KPFB) + l, 0, 3); \
                    FC_K_STEP(T, MR, NR, KSTEP, BSTEP)                          \
                }                                                               \
            else                                                                \
                /* two k a trip: Zen 5, 2 threads, builds alternating,      \
                   best GFLOPS 3x3/2 64->128 @56 b8 500-502 -> 507-513, 3x3 \
                   256->256 @14 b1 (Winograd) 774-787 -> 792-801, 1x1      \
                   256->64 @56 b8 backward 430-443 -> 453-461, 2048^3      \
                   +1 %; a 7x7 stem, 2048->512 @7 within 1 %. */             \
                FC_UNROLL_2                                                     \
                for (ptrdiff_t p = 0; p < kc; p++)                              \
                    FC_K_STEP(T, MR, NR, KSTEP, BSTEP)                          \
        }                                                                       \
        const VEC zero = {0}, six = zero + 6;                                   \
        FC_UNROLL for (int i = 0; i < (MR); i++)                                \
            FC_UNROLL for (int j = 0; j < NV; j++) {                            \
                T *o = out + i * rso + j * VL;                                  \
                VEC v = c[i][j], w;                                             \
                if (flags & FC_OUT_ADD) {                                       \
                    memcpy(&w, o, FC_VBYTES);                                   \
                    v = w + v;                                                  \
                }                                                               \
                if (bias) {                                                     \
                    memcpy(&w, bias + j * VL, FC_VBYTES);                       \
                    v = v + w;                                                  \
                }                                                               \
                if (act) {                                                      \
                    IVEC neg = v < zero;                                        \
                    v = (VEC)((IVEC)v & ~neg);                                  \
                }                                                               \
                if (act == 2) {                                                 \
                    IVEC big = v > six;                                         \
                    v = (VEC)(((IVEC)v & ~big) | ((IVEC)six & big));            \
                }                                                               \
                if (flags & FC_OUT_STREAM)                                      \
                    FC_STREAM_##SUFFIX(o, v);                                   \
                else                                                            \
                    memcpy(o, &v, FC_VBYTES);                                   \
            }                                                                   \
    }

#define FC_PLAIN_ROW(t, i) (a0 + (i) * rsa)
#define FC_SHARED_RUNS_ROW(t, i) (pix[i] + run_off[t])
/* A k-major slice (fc_kmajor_kernel): value (i, p) at a0[p*lda + i]. */
#define FC_KMAJOR_ROW(t, i) (a0 + (i))

#define FC_DEFINE_ROWS_KERNELS(SUFFIX, T, R, NR)                                 \
    static __attribute__((noinline)) void fc_micro_kernel_##SUFFIX##_##R(      \
        ptrdiff_t kc, const T *restrict a0, ptrdiff_t rsa, ptrdiff_t pf,        \
        const T *restrict b, T *restrict out, ptrdiff_t rso, int flags,         \
        const T *restrict bias, int act)                                        \
    FC_KERNEL_BODY(SUFFIX, T, R, NR, 1, FC_PLAIN_ROW, sizeof(T), pf)            \
    static inline void fc_shared_runs_kernel_##SUFFIX##_##R(                    \
        ptrdiff_t nruns, const ptrdiff_t *restrict run_off,                     \
        const T *const *restrict pix, ptrdiff_t kc, const T *restrict b,        \
        T *restrict out, ptrdiff_t rso, int flags, const T *restrict bias,      \
        int act)                                                                \
    FC_KERNEL_BODY(SUFFIX, T, R, NR, nruns, FC_SHARED_RUNS_ROW, sizeof(T), 0)   \
    static inline void fc_kmajor_kernel_##SUFFIX##_##R(                          \
        ptrdiff_t kc, const T *restrict a0, ptrdiff_t lda, const T *restrict b, \
        ptrdiff_t ldb, T *restrict out, ptrdiff_t rso, int flags,               \
        const T *restrict bias, int act, ptrdiff_t pfa, ptrdiff_t pfb)          \
    FC_KERNEL_BODY_PANELS(SUFFIX, T, R, NR, 1, 1, FC_KMAJOR_ROW, lda * sizeof(T), \
                          ldb, 0, b, pfa, pfb)

#define FC_MICRO_CASE(SUFFIX, T, R, NR)                                          \
    case R: fc_micro_kernel_##SUFFIX##_##R(kc, a0, rsa, pf, b, out, rso, flags, \
                                           bias, act); break;

#define FC_KMAJOR_CASE(SUFFIX, T, R, NR)                                         \
    case R: fc_kmajor_kernel_##SUFFIX##_##R(kc, a0, lda, b, ldb, out, rso,      \
                                            flags, bias, act, pfa, pfb); break;


/* Two adjacent NR panels at once (b, b2): an R x 2NR tile, for builds
 * whose registers hold it at FC_S_PAIR_MR rows (see multiply_pixel_rows and
 * macro_kernel_ld), with shared runs or plain rows (the latter with pf, as
 * fc_micro_kernel). */
#define FC_DEFINE_PAIR_KERNEL(SUFFIX, T, R, NR)                                  \
    static inline void fc_shared_runs_pair_kernel_##SUFFIX##_##R(               \
        ptrdiff_t nruns, const ptrdiff_t *restrict run_off,                     \
        const T *const *restrict pix, ptrdiff_t kc, const T *restrict b,        \
        const T *restrict b2_, T *restrict out, ptrdiff_t rso, int flags,       \
        const T *restrict bias, int act)                                        \
    FC_KERNEL_BODY_PANELS(SUFFIX, T, R, NR, 2, nruns, FC_SHARED_RUNS_ROW,       \
                          sizeof(T), NR, 0, b2_, 0, 0)                          \
    static __attribute__((noinline)) void fc_micro_pair_kernel_##SUFFIX##_##R( \
        ptrdiff_t kc, const T *restrict a0, ptrdiff_t rsa, ptrdiff_t pf,        \
        const T *restrict b, const T *restrict b2_, T *restrict out,            \
        ptrdiff_t rso, int flags, const T *restrict bias, int act)              \
    FC_KERNEL_BODY_PANELS(SUFFIX, T, R, NR, 2, 1, FC_PLAIN_ROW, sizeof(T), NR,  \
                          pf, b2_, 0, 0)
#define FC_PAIR_CASE(SUFFIX, T, R, NR)                                           \
    case R: fc_shared_runs_pair_kernel_##SUFFIX##_##R(nruns, run_off, pix, kc,  \
                                                      b, b2, out, rso, flags,   \
                                                      bias, act); break;
#define FC_MICRO_PAIR_CASE(SUFFIX, T, R, NR)                                     \
    case R: fc_micro_pair_kernel_##SUFFIX##_##R(kc, a0, rsa, pf, b, b2, out,    \
                                                rso, flags, bias, act); break;

#define FC_SHARED_RUNS_CASE(SUFFIX, T, R, NR)                                    \
    case R: fc_shared_runs_kernel_##SUFFIX##_##R(nruns, run_off, pix, kc, b, out, \
                                                 rso, flags, bias, act); break;

#define FC_FOR_6_ROWS(X, SUFFIX, T, NR)                                          \
    X(SUFFIX, T, 1, NR) X(SUFFIX, T, 2, NR) X(SUFFIX, T, 3, NR)                 \
    X(SUFFIX, T, 4, NR) X(SUFFIX, T, 5, NR) X(SUFFIX, T, 6, NR)
#define FC_FOR_ROWS(X, SUFFIX, T, NR)                                            \
    FC_FOR_6_ROWS(X, SUFFIX, T, NR)                                             \
    X(SUFFIX, T, 7, NR) X(SUFFIX, T, 8, NR) X(SUFFIX, T, 9, NR)                 \
    X(SUFFIX, T, 10, NR) X(SUFFIX, T, 11, NR) X(SUFFIX, T, 12, NR)              \
    X(SUFFIX, T, 13, NR) X(SUFFIX, T, 14, NR) X(SUFFIX, T, 15, NR)              \
    X(SUFFIX, T, 16, NR)

#define FC_DEFINE_MICRO_KERNELS(SUFFIX, T, IT, NR)                               \
    typedef T fc_vec_##SUFFIX __attribute__((vector_size(FC_VBYTES)));          \
    typedef IT fc_ivec_##SUFFIX __attribute__((vector_size(FC_VBYTES)));        \
    FC_FOR_ROWS(FC_DEFINE_ROWS_KERNELS, SUFFIX, T, NR)                          \
    static inline void fc_micro_kernel_##SUFFIX(                                \
        int mr, ptrdiff_t kc, const T *a0, ptrdiff_t rsa, ptrdiff_t pf,         \
        const T *b, T *out, ptrdiff_t rso, int flags, const T *bias, int act)   \
    {                                                                           \
        switch (mr) { FC_FOR_ROWS(FC_MICRO_CASE, SUFFIX, T, NR) }               \
    }                                                                           \
    static inline void fc_shared_runs_kernel_##SUFFIX(                          \
        int mr, ptrdiff_t nruns, const ptrdiff_t *run_off, const T *const *pix, \
        ptrdiff_t kc, const T *b, T *out, ptrdiff_t rso, int flags,             \
        const T *bias, int act)                                                 \
    {                                                                           \
        switch (mr) { FC_FOR_ROWS(FC_SHARED_RUNS_CASE, SUFFIX, T, NR) }         \
    }                                                                           \
    static inline void fc_kmajor_kernel_##SUFFIX(                               \
        int mr, ptrdiff_t kc, const T *a0, ptrdiff_t lda, const T *b,           \
        ptrdiff_t ldb, T *out, ptrdiff_t rso, int flags, const T *bias, int act, \
        ptrdiff_t pfa, ptrdiff_t pfb)                                           \
    {                                                                           \
        switch (mr) { FC_FOR_ROWS(FC_KMAJOR_CASE, SUFFIX, T, NR) }              \
    }

/* sum_k a[k] * x[k] over n contiguous values: four vector accumulators
 * (enough independent FMA chains to hide their latency), then the tail.
 * For products with one output row or column (GEMV), which the
 * packed-panel path would run at 1/NR of its width. */
#define FC_DEFINE_DOT(SUFFIX, T)                                                \
    static inline T fc_dot_##SUFFIX(const T *a, const T *x, ptrdiff_t n)        \
    {                                                                           \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        fc_vec_##SUFFIX acc[4], va, vx;                                         \
        ptrdiff_t k = 0;                                                        \
        T s = 0;                                                                \
        FC_UNROLL for (int u = 0; u < 4; u++) acc[u] = (fc_vec_##SUFFIX){0};    \
        for (; k + 4 * VL <= n; k += 4 * VL)                                    \
            FC_UNROLL for (int u = 0; u < 4; u++) {                             \
                memcpy(&va, a + k + u * VL, FC_VBYTES);                         \
                memcpy(&vx, x + k + u * VL, FC_VBYTES);                         \
                acc[u] += va * vx;                                              \
            }                                                                   \
        for (; k + VL <= n; k += VL) {                                          \
            memcpy(&va, a + k, FC_VBYTES);                                      \
            memcpy(&vx, x + k, FC_VBYTES);                                      \
            acc[0] += va * vx;                                                  \
        }                                                                       \
        acc[0] = (acc[0] + acc[1]) + (acc[2] + acc[3]);                         \
        FC_UNROLL for (int l = 0; l < VL; l++) s += acc[0][l];                  \
        for (; k < n; k++) s += a[k] * x[k];                                    \
        return s;                                                               \
    }

/* Square transposes of 32 bytes a row (8x8 floats, 4x4 doubles) in
 * vector registers: dst row q, column r = src row r, column q.  The packs
 * below gathered their values one scalar load and store at a time (~3.5
 * cycles a value: a 9.4 MB filter took 0.28 ms on 2 cores, most of a
 * 512->512 @7 batch-1 convolution's extra cost over prepacked weights).
 * Written with generic 32-byte vectors, so every build gets the shuffles
 * it has (AVX: unpck/shuf/vperm2f128; SSE2 and NEON: pairs of halves).
 * dst = s * src^T: the Winograd few-tile path scales its taps on the way
 * (the packs pass s = 1, which the compiler drops once inlined).  Always
 * inlined: with s, GCC made it an out-of-line clone called per square
 * (seen in a profile of the Winograd path; the packs inlined it before s
 * and should keep their code). */
typedef float fc_v8sf __attribute__((vector_size(32)));
typedef double fc_v4df __attribute__((vector_size(32)));
/* GCC takes the lane indices as a vector of the integer type IT. */
typedef int fc_v8si __attribute__((vector_size(32)));
typedef long long fc_v4di __attribute__((vector_size(32)));
#if defined(__clang__)
#define FC_SHUFFLE(IT, a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
#else
#define FC_SHUFFLE(IT, a, b, ...) __builtin_shuffle((a), (b), (IT){__VA_ARGS__})
#endif
#define FC_SHUF8(a, b, ...) FC_SHUFFLE(fc_v8si, a, b, __VA_ARGS__)
#define FC_SHUF4(a, b, ...) FC_SHUFFLE(fc_v4di, a, b, __VA_ARGS__)

static inline __attribute__((always_inline)) void fc_transpose_sq_f32(
    const float *src, ptrdiff_t lds, float *dst, ptrdiff_t ldd, float s)
{
    fc_v8sf r[8], t[8], u[8], o;
    for (int i = 0; i < 8; i++) memcpy(&r[i], src + i * lds, 32);
    for (int i = 0; i < 8; i += 2) {
        t[i] = FC_SHUF8(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = FC_SHUF8(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = FC_SHUF8(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 1] = FC_SHUF8(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 2] = FC_SHUF8(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = FC_SHUF8(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int q = 0; q < 4; q++) {
        o = s * FC_SHUF8(u[q], u[q + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        memcpy(dst + q * ldd, &o, 32);
        o = s * FC_SHUF8(u[q], u[q + 4], 4, 5, 6, 7, 12, 13, 14, 15);
        memcpy(dst + (q + 4) * ldd, &o, 32);
    }
}

static inline __attribute__((always_inline)) void fc_transpose_sq_f64(
    const double *src, ptrdiff_t lds, double *dst, ptrdiff_t ldd, double s)
{
    fc_v4df r[4], t[4], o;
    for (int i = 0; i < 4; i++) memcpy(&r[i], src + i * lds, 32);
    for (int i = 0; i < 4; i += 2) {
        t[i] = FC_SHUF4(r[i], r[i + 1], 0, 4, 2, 6);
        t[i + 1] = FC_SHUF4(r[i], r[i + 1], 1, 5, 3, 7);
    }
    for (int q = 0; q < 2; q++) {
        o = s * FC_SHUF4(t[q], t[q + 2], 0, 1, 4, 5);
        memcpy(dst + q * ldd, &o, 32);
        o = s * FC_SHUF4(t[q], t[q + 2], 2, 3, 6, 7);
        memcpy(dst + (q + 2) * ldd, &o, 32);
    }
}

/* Pack NR columns of B = W^T, where W's rows (B's columns) are contiguous:
 * dst[p*NR + j] = b[j*csb + p] for j < nr, zero for nr <= j < NR.  Conv
 * weights (OC x K rows) reach the GEMM this way.  Reading one element of
 * each of NR rows per p, as a generic strided pack does, touches NR rows
 * that are K elements apart: with K*sizeof(T) a multiple of 4 KiB they all
 * fall in one L1 set and every load misses (measured: ~15 cycles per
 * element, half of a 2048->512 1x1 layer at batch 1).  So each row gives
 * KB contiguous values (4 cache lines) at a time into a tile transposed
 * from L1, and the rows' next lines are prefetched: NR streams at once are
 * more than the hardware prefetcher follows. */
#define FC_DEFINE_PACK_BT(SUFFIX, T, NR)                                        \
    static inline void fc_pack_bt_##SUFFIX(ptrdiff_t kc, ptrdiff_t nr,         \
                                           const T *b, ptrdiff_t csb,           \
                                           T *restrict dst)                     \
    {                                                                           \
        enum { KB = 256 / sizeof(T), SQ = 32 / sizeof(T) };                     \
        _Static_assert((NR) % SQ == 0, "NR must be a multiple of the square");  \
        T tile[NR][KB];                                                         \
        for (ptrdiff_t j = nr; j < (NR); j++)                                   \
            memset(tile[j], 0, sizeof tile[j]);                                 \
        for (ptrdiff_t p0 = 0; p0 < kc; p0 += KB) {                             \
            ptrdiff_t pk = kc - p0 < KB ? kc - p0 : KB;                         \
            for (ptrdiff_t j = 0; j < nr; j++) {                                \
                const T *src = b + j * csb + p0;                                \
                if (p0 + 2 * KB <= kc)                                          \
                    for (int l = 0; l < 256; l += 64)                           \
                        __builtin_prefetch((const char *)(src + KB) + l);       \
                if (pk == KB)                                                   \
                    memcpy(tile[j], src, sizeof tile[j]);                       \
                else                                                            \
                    memcpy(tile[j], src, pk * sizeof(T));                       \
            }                                                                   \
            /* whole squares in registers, the last < SQ values of p one  \
               at a time */                                                    \
            ptrdiff_t p = 0;                                                    \
            for (; p + SQ <= pk; p += SQ)                                       \
                for (int j = 0; j < (NR); j += SQ)                              \
                    fc_transpose_sq_##SUFFIX(&tile[j][p], KB,                   \
                                             dst + (p0 + p) * (NR) + j, (NR), 1); \
            for (; p < pk; p++) {                                               \
                T *d = dst + (p0 + p) * (NR);                                   \
                FC_UNROLL for (int j = 0; j < (NR); j++)                        \
                    d[j] = tile[j][p];                                          \
            }                                                                   \
        }                                                                       \
    }

/* at[j*ldt + i] = a[i*rsa + j] for a block of rows i0..i1 (at most TB)
 * and columns j0..j1 (at most TB): both sides move whole cache lines, the
 * transpose itself happens in an L1 tile (the same idea as the B pack). */
#define FC_DEFINE_TRANSPOSE_BLOCK(SUFFIX, T)                                    \
    enum { FC_TB_##SUFFIX = 64 / sizeof(T) };                                   \
    static inline void fc_transpose_block_##SUFFIX(                             \
        ptrdiff_t i0, ptrdiff_t i1, ptrdiff_t j0, ptrdiff_t j1,                 \
        const T *a, ptrdiff_t rsa, T *restrict at, ptrdiff_t ldt)               \
    {                                                                           \
        enum { TB = FC_TB_##SUFFIX };                                           \
        T tile[TB][TB];                                                         \
        ptrdiff_t ni = i1 - i0, nj = j1 - j0;                                   \
        if (nj == TB)        /* a fixed size: one vector load, not a call */    \
            for (ptrdiff_t i = 0; i < ni; i++)                                  \
                memcpy(tile[i], a + (i0 + i) * rsa + j0, sizeof tile[i]);       \
        else                                                                    \
            for (ptrdiff_t i = 0; i < ni; i++)                                  \
                memcpy(tile[i], a + (i0 + i) * rsa + j0, nj * sizeof(T));       \
        if (ni == TB) {                                                         \
            enum { SQ = 32 / sizeof(T) };                                       \
            ptrdiff_t j = 0;                                                    \
            for (; j + SQ <= nj; j += SQ)                                       \
                FC_UNROLL for (int i = 0; i < TB; i += SQ)                      \
                    fc_transpose_sq_##SUFFIX(&tile[i][j], TB,                   \
                                             at + (j0 + j) * ldt + i0 + i, ldt, 1); \
            for (; j < nj; j++) {                                               \
                T *d = at + (j0 + j) * ldt + i0;                                \
                FC_UNROLL for (int i = 0; i < TB; i++) d[i] = tile[i][j];       \
            }                                                                   \
        } else {                                                                \
            for (ptrdiff_t j = 0; j < nj; j++)                                  \
                for (ptrdiff_t i = 0; i < ni; i++)                              \
                    at[(j0 + j) * ldt + i0 + i] = tile[i][j];                   \
        }                                                                       \
    }

/* Bring nrows rows of row_bytes each (row_stride bytes apart) into L2, to
 * read (fc_prefetch_rows) or to write (fc_prefetchw_rows).  The GEMM asks
 * for its next A slice and C tile while the current ones are multiplied:
 * read in place, an A slice is MR short runs (one per row), too short for
 * the hardware prefetcher to learn before they end, and an output larger
 * than L2 misses on every tile it stores (measured: 1x1 256->64 convolution
 * at batch 8, 142 -> 165 GFLOPS).  L2, not L1: the hint to L1 evicted the
 * slice being used and ran slower. */
static inline void fc_prefetch_rows(const void *p, ptrdiff_t nrows, ptrdiff_t row_stride,
                                    ptrdiff_t row_bytes)
{
    const char *c = (const char *)p;
    for (ptrdiff_t i = 0; i < nrows; i++)
        for (ptrdiff_t l = 0; l < row_bytes; l += 64)
            __builtin_prefetch(c + i * row_stride + l, 0, 2);
}

static inline void fc_prefetchw_rows(void *p, ptrdiff_t nrows, ptrdiff_t row_stride,
                                     ptrdiff_t row_bytes)
{
    char *c = (char *)p;
    for (ptrdiff_t i = 0; i < nrows; i++)
        for (ptrdiff_t l = 0; l < row_bytes; l += 64)
            __builtin_prefetch(c + i * row_stride + l, 1, 2);
}

/* Non-temporal row stores for output tiles that are written once and not
 * read back soon (an output much larger than L2): they skip the read for
 * ownership a normal store does on a line it misses, measured 6-10 % of a
 * 1x1 convolution at batch 8 (25 MB output).  dst[j] = act(alpha * src[j]
 * (+ bias[j])) for j < n, n a multiple of the vector length, dst
 * vector-aligned; act as in the GEMM epilogue (1 relu, 2 relu6; NaN stays
 * NaN).  Builds without x86 streaming stores use plain ones. */
#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#define FC_HAVE_STREAM 1
#else
#define FC_HAVE_STREAM 0
#endif
#if FC_VBYTES == 64
#define FC_STREAM_f32(p, v) _mm512_stream_ps((p), (__m512)(v))
#define FC_STREAM_f64(p, v) _mm512_stream_pd((p), (__m512d)(v))
#elif FC_VBYTES == 32
#define FC_STREAM_f32(p, v) _mm256_stream_ps((p), (__m256)(v))
#define FC_STREAM_f64(p, v) _mm256_stream_pd((p), (__m256d)(v))
#elif FC_HAVE_STREAM
#define FC_STREAM_f32(p, v) _mm_stream_ps((p), (__m128)(v))
#define FC_STREAM_f64(p, v) _mm_stream_pd((p), (__m128d)(v))
#else
#define FC_STREAM_f32(p, v) memcpy((p), &(v), FC_VBYTES)
#define FC_STREAM_f64(p, v) memcpy((p), &(v), FC_VBYTES)
#endif

#define FC_DEFINE_STREAM_ROW(SUFFIX, T, IT)                                     \
    static inline void fc_stream_row_##SUFFIX(T *dst, const T *src, ptrdiff_t n, \
                                              T alpha, const T *bias, int act)  \
    {                                                                           \
        typedef IT ivec __attribute__((vector_size(FC_VBYTES)));                \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        const fc_vec_##SUFFIX zero = {0}, six = zero + 6;                       \
        for (ptrdiff_t j = 0; j < n; j += VL) {                                 \
            fc_vec_##SUFFIX v, bv;                                              \
            memcpy(&v, src + j, FC_VBYTES);                                     \
            v = v * alpha;                                                      \
            if (bias) {                                                         \
                memcpy(&bv, bias + j, FC_VBYTES);                               \
                v = v + bv;                                                     \
            }                                                                   \
            if (act) {   /* masks, not max(): a NaN compares false */           \
                ivec neg = v < zero;                                            \
                v = (fc_vec_##SUFFIX)((ivec)v & ~neg);                          \
            }                                                                   \
            if (act == 2) {                                                     \
                ivec big = v > six;                                             \
                v = (fc_vec_##SUFFIX)(((ivec)v & ~big) | ((ivec)six & big));    \
            }                                                                   \
            FC_STREAM_##SUFFIX(dst + j, v);                                     \
        }                                                                       \
    }

/* Orders this thread's streaming stores before what follows (they are
 * weakly ordered): called before a task ends. */
static inline void fc_store_fence(void)
{
#if FC_HAVE_STREAM
    _mm_sfence();
#endif
}

#if FC_S_MR > 16 || FC_D_MR > 16
#error "micro-kernels exist for at most 16 rows"
#endif
#ifndef FC_S_PAIR_MR
#define FC_S_PAIR_MR 0
#endif
FC_DEFINE_MICRO_KERNELS(f32, float, int, FC_S_NR)
FC_DEFINE_MICRO_KERNELS(f64, double, long long, FC_D_NR)
FC_DEFINE_DOT(f32, float)
/* The float32 paired-panel kernels, 1..FC_S_PAIR_MR rows (6: 24 zmm
 * accumulators); a build without them (FC_S_PAIR_MR 0) never calls the
 * dispatcher. */
#if FC_S_PAIR_MR == 6
FC_FOR_6_ROWS(FC_DEFINE_PAIR_KERNEL, f32, float, FC_S_NR)
#elif FC_S_PAIR_MR != 0
#error "paired-panel kernels exist for 6 rows"
#endif
static inline void fc_shared_runs_pair_kernel_f32(
    int mr, ptrdiff_t nruns, const ptrdiff_t *run_off, const float *const *pix,
    ptrdiff_t kc, const float *b, const float *b2, float *out, ptrdiff_t rso,
    int flags, const float *bias, int act)
{
#if FC_S_PAIR_MR == 6
    switch (mr) { FC_FOR_6_ROWS(FC_PAIR_CASE, f32, float, FC_S_NR) }
#else
    (void)mr; (void)nruns; (void)run_off; (void)pix; (void)kc; (void)b; (void)b2;
    (void)out; (void)rso; (void)flags; (void)bias; (void)act;
#endif
}
static inline void fc_micro_pair_kernel_f32(
    int mr, ptrdiff_t kc, const float *a0, ptrdiff_t rsa, ptrdiff_t pf,
    const float *b, const float *b2, float *out, ptrdiff_t rso, int flags,
    const float *bias, int act)
{
#if FC_S_PAIR_MR == 6
    switch (mr) { FC_FOR_6_ROWS(FC_MICRO_PAIR_CASE, f32, float, FC_S_NR) }
#else
    (void)mr; (void)kc; (void)a0; (void)rsa; (void)pf; (void)b; (void)b2;
    (void)out; (void)rso; (void)flags; (void)bias; (void)act;
#endif
}
FC_DEFINE_PACK_BT(f32, float, FC_S_NR)
FC_DEFINE_PACK_BT(f64, double, FC_D_NR)
FC_DEFINE_TRANSPOSE_BLOCK(f32, float)
FC_DEFINE_TRANSPOSE_BLOCK(f64, double)
FC_DEFINE_DOT(f64, double)
FC_DEFINE_STREAM_ROW(f32, float, int)
FC_DEFINE_STREAM_ROW(f64, double, long long)

#endif
