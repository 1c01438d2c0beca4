/* Winograd F(2x2, 3x3) for thin layers: 3x3 stride-1 convolutions with few
 * input channels (C <= FC_WINO_THIN_MAX_C), such as a network's first layer
 * on RGB pixels (VGG's conv1_1, 3 -> 64 @224: K = 27).  One source for
 * every ISA build; requires micro_kernel.h and winograd_kernel.h first.
 *
 * Implicit GEMM runs such a layer near the FMA peak, but F(2x2) needs 2.25x
 * fewer multiplications.  The general Winograd path cannot use them: its 16
 * GEMMs are (tiles x C) @ (C x OC), 3 deep, and it ran VGG's conv1_1 at
 * half implicit GEMM's speed.  Here the products and the output transform
 * of a few tiles are done in registers instead.
 *
 * Per band of two output rows, a chunk of tiles at a time:
 * 1. fc_wino_thin_window: the chunk's 4 x (2 nt + 3) input pixels (zeros
 *    in the padding) -> B^T over its rows, vectorised along the row's
 *    values -> B^T over its columns at every value position: V, 16 rows
 *    (points) FC_WINO_THIN_ROW_BYTES apart, point e of tile j channel c at
 *    v[e*LDV + 2*C*j + c].  Half the positions (the odd columns) are made
 *    and never read: one vector loop over all of them costs less than
 *    picking them out.
 * 2. fc_wino_thin_tiles: per vector of output channels, FC_WINO_THIN_NT
 *    tiles at a time.  For each row r of points, each of its 4 x C filter
 *    vectors U (one register) is multiplied into the NT tiles' 4
 *    accumulators of the row by FMAs whose other operand is the tile's V
 *    value, broadcast from memory; the row's A^T then folds them into the
 *    tiles' 2x2 outputs (4 NT registers), finished with bias, residual and
 *    activation.  Measured on Zen 4 (one core, ns per 16 zmm FMAs): 4.8
 *    from registers, 4.8 with an embedded broadcast operand, 5.5 with a
 *    vector memory operand, 9.5 with a vector operand and a broadcast each:
 *    so U stays in a register for NT tiles and V comes as the broadcast.
 *    The two-pass form (all tiles' 16 points to memory, then the output
 *    transform) ran 1.7 ms where this runs 0.84 (224x224, 3 -> 64, one
 *    thread; implicit GEMM 1.70).
 *
 * The filter transform is G g G^T of winograd_kernel.h's F(2x2) (points 0,
 * +-1: its rounding error is about the direct method's), per call: 16 x C x
 * OC values (12 KiB for conv1_1). */
#ifndef FASTCONV_WINOGRAD_THIN_KERNEL_H
#define FASTCONV_WINOGRAD_THIN_KERNEL_H

#include <stddef.h>
#include <string.h>

/* Thin means fewer input channels than the general path's GEMMs need (see
 * conv.py, _winograd_pays: at least 16). */
#define FC_WINO_THIN_MAX_C 15
/* One V row (a point of a chunk's tiles): a constant, so that the kernel
 * reaches all 16 points by displacements off one pointer. */
#define FC_WINO_THIN_ROW_BYTES 1024
/* Tiles per kernel call: 4 NT accumulators, 4 NT outputs and a filter
 * vector in registers (25 for NT 3 of 32 on AVX-512 and NEON; 16 registers
 * leave room for one tile). */
#if FC_VBYTES == 64 || defined(__aarch64__)
#define FC_WINO_THIN_NT 3
#else
#define FC_WINO_THIN_NT 1
#endif

static inline ptrdiff_t fc_wino_thin_chunk_tiles(ptrdiff_t C, size_t item)
{
    return (ptrdiff_t)(FC_WINO_THIN_ROW_BYTES / item) / (2 * C);
}

/* Values per row of a chunk's window and of its row transform (d and t
 * of fc_wino_thin_window): 2 nt + 3 pixels of C channels. */
static inline ptrdiff_t fc_wino_thin_window_ld(ptrdiff_t C, ptrdiff_t nt)
{
    return (2 * nt + 3) * C;
}

/* Channel c of a row of points: each of its 4 filter vectors times the NT
 * tiles' values, into (OP =) or onto (OP +=) their accumulators. */
#define FC_WINO_THIN_STEP(T, NT, CC, c, OP)                                     \
    FC_UNROLL for (int s = 0; s < 4; s++) {                                     \
        VEC w_;                                                                 \
        memcpy(&w_, ur_ + ((c) * 4 + s) * VL_, FC_VBYTES);                      \
        /* in a register: else GCC reads it as each FMA's memory operand   \
           and broadcasts V separately. */                                   \
        FC_WINO_NO_CONTRACT(w_);                                                \
        FC_UNROLL for (int t = 0; t < (NT); t++)                                \
            acc_[t][s] OP vr_[s * LDV_ + 2 * (CC) * t + (c)] * w_;              \
    }

/* The kernels' body for NT tiles (a constant) and CC input channels (a
 * constant, or the variable C).  Point (r, s) of tile t, channel c, at
 * v[(4r + s)*LDV + 2*CC*t + c]; its filter vector at u[((r*CC + c)*4 +
 * s)*VL].  Output (i, j) of tile t at y + i*syh + (2t + j)*syw. */
#define FC_WINO_THIN_BODY(SUFFIX, T, NT, CC)                                    \
    {                                                                           \
        typedef fc_vec_##SUFFIX VEC;                                            \
        enum { VL_ = FC_VBYTES / sizeof(T),                                     \
               LDV_ = FC_WINO_THIN_ROW_BYTES / sizeof(T) };                     \
        VEC out_[NT][2][2];                                                     \
        FC_UNROLL for (int r = 0; r < 4; r++) {                                 \
            VEC acc_[NT][4];                                                    \
            const T *ur_ = u + r * (CC) * 4 * VL_;                              \
            const T *vr_ = v + r * 4 * LDV_;                                    \
            FC_WINO_THIN_STEP(T, NT, CC, 0, =)                                  \
            for (ptrdiff_t c = 1; c < (CC); c++)                                \
                FC_WINO_THIN_STEP(T, NT, CC, c, +=)                             \
            /* A^T over the row's 4 points, then row r's share of the      \
               tile's two output rows (A^T's columns: 1 1 1 0, 0 1 -1 -1). */ \
            FC_UNROLL for (int t = 0; t < (NT); t++) {                          \
                VEC a_ = acc_[t][0] + acc_[t][1] + acc_[t][2];                  \
                VEC b_ = acc_[t][1] - acc_[t][2] - acc_[t][3];                  \
                if (r == 0) {                                                   \
                    out_[t][0][0] = a_;                                         \
                    out_[t][0][1] = b_;                                         \
                } else if (r == 1) {                                            \
                    out_[t][0][0] += a_;                                        \
                    out_[t][0][1] += b_;                                        \
                    out_[t][1][0] = a_;                                         \
                    out_[t][1][1] = b_;                                         \
                } else if (r == 2) {                                            \
                    out_[t][0][0] += a_;                                        \
                    out_[t][0][1] += b_;                                        \
                    out_[t][1][0] -= a_;                                        \
                    out_[t][1][1] -= b_;                                        \
                } else {                                                        \
                    out_[t][1][0] -= a_;                                        \
                    out_[t][1][1] -= b_;                                        \
                }                                                               \
            }                                                                   \
        }                                                                       \
        if (fast) {                                                             \
            typedef fc_wino_mask_##SUFFIX fc_wino_mask_t;                       \
            VEC b_;                                                             \
            memcpy(&b_, bias, FC_VBYTES);                                       \
            FC_UNROLL for (int t = 0; t < (NT); t++)                            \
                FC_UNROLL for (int i = 0; i < 2; i++)                           \
                    FC_UNROLL for (int j = 0; j < 2; j++) {                     \
                        VEC o_ = out_[t][i][j] + b_;                            \
                        FC_WINO_ACT_VECTOR(T, VEC, o_);                         \
                        T *p_ = y + i * syh + (2 * t + j) * syw;                \
                        if (flags & FC_OUT_STREAM)                              \
                            FC_STREAM_##SUFFIX(p_, o_);                         \
                        else                                                    \
                            memcpy(p_, &o_, FC_VBYTES);                         \
                    }                                                           \
        } else                                                                  \
            fc_wino_thin_finish_##SUFFIX(&out_[0][0][0], NT, y, syw, syh, bias, \
                                         act, flags, rows, cols, lanes);        \
    }

/* The thin kernels for NT tiles: C of 1 to 4 (grey, RGB, RGBA) unrolled,
 * more as a loop.  A function each: in one body GCC hoisted the loads the
 * cases share above the switch (16 broadcasts held in registers). */
#define FC_WINO_THIN_ARGS(T)                                                    \
    const T *restrict v, const T *restrict u, T *restrict y, ptrdiff_t syw,     \
    ptrdiff_t syh, const T *restrict bias, int act, int flags, int rows,        \
    int cols, int lanes, int fast
#define FC_DEFINE_WINO_THIN_C(SUFFIX, T, NT, CC, NAME)                          \
    static __attribute__((noinline)) void fc_wino_thin_##SUFFIX##_##NT##_##NAME( \
        ptrdiff_t C, FC_WINO_THIN_ARGS(T))                                      \
    {                                                                           \
        (void)C;                                                                \
        FC_WINO_THIN_BODY(SUFFIX, T, NT, CC)                                    \
    }
#define FC_DEFINE_WINO_THIN_NT(SUFFIX, T, NT)                                   \
    FC_DEFINE_WINO_THIN_C(SUFFIX, T, NT, 1, c1)                                 \
    FC_DEFINE_WINO_THIN_C(SUFFIX, T, NT, 2, c2)                                 \
    FC_DEFINE_WINO_THIN_C(SUFFIX, T, NT, 3, c3)                                 \
    FC_DEFINE_WINO_THIN_C(SUFFIX, T, NT, 4, c4)                                 \
    FC_DEFINE_WINO_THIN_C(SUFFIX, T, NT, C, cn)                                 \
    static void fc_wino_thin_##SUFFIX##_##NT(                                   \
        ptrdiff_t C, const T *v, const T *u, T *y, ptrdiff_t syw,               \
        ptrdiff_t syh, const T *bias, int act, int flags, int rows, int cols,   \
        int lanes)                                                              \
    {                                                                           \
        /* whole tiles and vector, nothing to add */                          \
        int fast = (rows == 2 && cols == 2 && lanes == FC_VBYTES / (int)sizeof(T) \
                    && !(flags & FC_OUT_ADD));                                  \
        void (*kernel)(ptrdiff_t, FC_WINO_THIN_ARGS(T)) =                       \
            C == 1 ? fc_wino_thin_##SUFFIX##_##NT##_c1                          \
            : C == 2 ? fc_wino_thin_##SUFFIX##_##NT##_c2                        \
            : C == 3 ? fc_wino_thin_##SUFFIX##_##NT##_c3                        \
            : C == 4 ? fc_wino_thin_##SUFFIX##_##NT##_c4                        \
                     : fc_wino_thin_##SUFFIX##_##NT##_cn;                       \
        kernel(C, v, u, y, syw, syh, bias, act, flags, rows, cols, lanes, fast); \
    }

#if FC_WINO_THIN_NT == 3
#define FC_WINO_THIN_FOR_NT(X, SUFFIX, T) X(SUFFIX, T, 1) X(SUFFIX, T, 2) X(SUFFIX, T, 3)
#else
#define FC_WINO_THIN_FOR_NT(X, SUFFIX, T) X(SUFFIX, T, 1)
#endif

/* The first lanes values of a vector, to or from memory: masked on
 * AVX-512 (a memcpy of a variable length is a library call per vector,
 * and a partial last vector of channels, 24 of 32, made the whole layer
 * 1.5-2x slower than one of 16); a loop elsewhere. */
#if defined(__AVX512F__) && FC_VBYTES == 64
#define FC_WINO_THIN_LOAD_PART_f32(v, p, n)                                     \
    v = (fc_vec_f32)_mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1), (p))
#define FC_WINO_THIN_STORE_PART_f32(p, v, n)                                    \
    _mm512_mask_storeu_ps((p), (__mmask16)((1u << (n)) - 1), (__m512)(v))
#define FC_WINO_THIN_LOAD_PART_f64(v, p, n)                                     \
    v = (fc_vec_f64)_mm512_maskz_loadu_pd((__mmask8)((1u << (n)) - 1), (p))
#define FC_WINO_THIN_STORE_PART_f64(p, v, n)                                    \
    _mm512_mask_storeu_pd((p), (__mmask8)((1u << (n)) - 1), (__m512d)(v))
#else
#define FC_WINO_THIN_LOAD_PART_f32(v, p, n)                                     \
    do {                                                                        \
        v = (__typeof__(v)){0};                                                 \
        for (int l_ = 0; l_ < (n); l_++) v[l_] = (p)[l_];                       \
    } while (0)
#define FC_WINO_THIN_STORE_PART_f32(p, v, n)                                    \
    for (int l_ = 0; l_ < (n); l_++) (p)[l_] = (v)[l_]
#define FC_WINO_THIN_LOAD_PART_f64 FC_WINO_THIN_LOAD_PART_f32
#define FC_WINO_THIN_STORE_PART_f64 FC_WINO_THIN_STORE_PART_f32
#endif

#define FC_DEFINE_WINO_THIN(SUFFIX, T)                                          \
    /* One output vector: + bias (a whole vector, never NULL: the frame   \
       pads it, zeros without one), + what y holds when FC_OUT_ADD, the    \
       activation; lanes < VL for a last, partial vector of channels      \
       (never streamed). */                                                 \
    static inline void fc_wino_thin_store_##SUFFIX(                             \
        T *o, fc_vec_##SUFFIX val, const T *bias, int act, int flags,          \
        int lanes)                                                              \
    {                                                                           \
        typedef fc_vec_##SUFFIX VEC;                                            \
        typedef fc_wino_mask_##SUFFIX fc_wino_mask_t;                           \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        VEC w;                                                                  \
        memcpy(&w, bias, FC_VBYTES);                                            \
        val += w;                                                               \
        if (lanes == VL) {                                                      \
            if (flags & FC_OUT_ADD) {                                           \
                memcpy(&w, o, FC_VBYTES);                                       \
                val += w;                                                       \
            }                                                                   \
            FC_WINO_ACT_VECTOR(T, VEC, val);                                    \
            if (flags & FC_OUT_STREAM)                                          \
                FC_STREAM_##SUFFIX(o, val);                                     \
            else                                                                \
                memcpy(o, &val, FC_VBYTES);                                     \
        } else {                                                                \
            if (flags & FC_OUT_ADD) {                                           \
                FC_WINO_THIN_LOAD_PART_##SUFFIX(w, o, lanes);                   \
                val += w;                                                       \
            }                                                                   \
            FC_WINO_ACT_VECTOR(T, VEC, val);                                    \
            FC_WINO_THIN_STORE_PART_##SUFFIX(o, val, lanes);                    \
        }                                                                       \
    }                                                                           \
                                                                                \
    /* The nt tiles' outputs res[(t*2 + i)*2 + j] finished and stored (see \
       FC_WINO_THIN_BODY).  Out of line: with the epilogue's branches in   \
       its body, GCC loaded every V value and filter vector up front and  \
       spilled them (0 embedded broadcasts, 771 stack accesses in the     \
       3-tile kernel for C = 3; 144 and none this way). */                 \
    static __attribute__((noinline)) void fc_wino_thin_finish_##SUFFIX(        \
        const fc_vec_##SUFFIX *res, int nt, T *y, ptrdiff_t syw, ptrdiff_t syh, \
        const T *bias, int act, int flags, int rows, int cols, int lanes)       \
    {                                                                           \
        for (int t = 0; t < nt; t++)                                            \
            for (int i = 0; i < rows; i++)                                      \
                for (int j = 0; j < (t < nt - 1 ? 2 : cols); j++)               \
                    fc_wino_thin_store_##SUFFIX(y + i * syh + (2 * t + j) * syw, \
                                                res[(t * 2 + i) * 2 + j], bias, \
                                                act, flags, lanes);             \
    }                                                                           \
                                                                                \
    FC_WINO_THIN_FOR_NT(FC_DEFINE_WINO_THIN_NT, SUFFIX, T)                      \
                                                                                \
    /* The filters: for vector q of output channels, point (r, s), input   \
       channel c, U = G g G^T at u + (((q*4 + r)*C + c)*4 + s)*VL + lane,   \
       zeros past OC; w (OC x 9*C) OHWI, rows rsw apart.  A vector of     \
       output channels at a time, its rows transposed into wt first (taps \
       gathered lane by lane stalled every vector load on its 16 scalar   \
       stores; one filter at a time took 4.5 ns a filter: 10 us of a call \
       with 8 -> 256 channels, a 50 us layer by implicit GEMM).  flipped: \
       w is (C x 9*OC), the weight of the convolution whose input         \
       gradient this is, its taps reversed: tap k of input channel c is   \
       row c's tap 8 - k, whose output channels are already contiguous. */ \
    static void fc_wino_thin_filter_##SUFFIX(                                   \
        const T *w, ptrdiff_t rsw, ptrdiff_t C, ptrdiff_t OC, int flipped,      \
        T *restrict u)                                                          \
    {                                                                           \
        typedef fc_vec_##SUFFIX VEC;                                            \
        enum { VL = FC_VBYTES / sizeof(T), TB = FC_TB_##SUFFIX };               \
        T wt[9 * FC_WINO_THIN_MAX_C * VL];  /* wt[k*VL + lane] = w[lane, k] */  \
        for (ptrdiff_t q = 0; q * VL < OC; q++) {                               \
            ptrdiff_t ni = OC - q * VL < VL ? OC - q * VL : VL;                 \
            if (ni < VL)                                                        \
                memset(wt, 0, 9 * C * VL * sizeof(T));                          \
            if (flipped)                                                        \
                for (int k = 0; k < 9; k++)                                     \
                    for (ptrdiff_t c = 0; c < C; c++)                           \
                        memcpy(wt + (k * C + c) * VL,                           \
                               w + c * rsw + (8 - k) * OC + q * VL,             \
                               ni * sizeof(T));                                 \
            else                                                                \
                for (ptrdiff_t j0 = 0; j0 < 9 * C; j0 += TB)                    \
                    fc_transpose_block_##SUFFIX(0, ni, j0,                      \
                                                j0 + TB < 9 * C ? j0 + TB : 9 * C, \
                                                w + q * VL * rsw, rsw, wt, VL); \
            for (ptrdiff_t c = 0; c < C; c++) {                                 \
                VEC g[3][3], col[3], tcol[4], gt[4][3], row[4];                 \
                for (int a = 0; a < 3; a++)                                     \
                    for (int b = 0; b < 3; b++)                                 \
                        memcpy(&g[a][b], wt + ((a * 3 + b) * C + c) * VL, FC_VBYTES); \
                for (int b = 0; b < 3; b++) {                                   \
                    for (int a = 0; a < 3; a++) col[a] = g[a][b];               \
                    FC_WINO2_G(T, col, tcol);                                   \
                    for (int r = 0; r < 4; r++) gt[r][b] = tcol[r];             \
                }                                                               \
                for (int r = 0; r < 4; r++) {                                   \
                    FC_WINO2_G(T, gt[r], row);                                  \
                    for (int s = 0; s < 4; s++)                                 \
                        memcpy(u + (((q * 4 + r) * C + c) * 4 + s) * VL, &row[s], \
                               FC_VBYTES);                                      \
                }                                                               \
            }                                                                   \
        }                                                                       \
    }                                                                           \
                                                                                \
    /* A chunk's V (see the top): the window of input rows ih0..ih0+3 and  \
       columns iw0..iw0+2nt+2 of one image (x at its pixel (0, 0), rows sh \
       and pixels sw apart, C channels contiguous), zeros outside H x W,   \
       through d and t (4 rows of fc_wino_thin_window_ld values each). */   \
    static void fc_wino_thin_window_##SUFFIX(                                   \
        const T *x, ptrdiff_t sh, ptrdiff_t sw, ptrdiff_t H, ptrdiff_t W,       \
        ptrdiff_t C, ptrdiff_t ih0, ptrdiff_t iw0, ptrdiff_t nt,                \
        T *restrict d, T *restrict t, T *restrict v)                            \
    {                                                                           \
        enum { LDV = FC_WINO_THIN_ROW_BYTES / sizeof(T) };                      \
        ptrdiff_t nq = 2 * nt + 3, ld = nq * C;                                 \
        /* the window's columns q0..q1 are in the image */                   \
        ptrdiff_t q0 = iw0 < 0 ? -iw0 : 0;                                      \
        ptrdiff_t q1 = W - iw0 < nq ? W - iw0 : nq;                             \
        for (int r = 0; r < 4; r++) {                                           \
            T *dr = d + r * ld;                                                 \
            ptrdiff_t ih = ih0 + r;                                             \
            if (ih < 0 || ih >= H || q1 <= q0) {                                \
                memset(dr, 0, ld * sizeof(T));                                  \
                continue;                                                       \
            }                                                                   \
            const T *src = x + ih * sh + (iw0 + q0) * sw;                       \
            memset(dr, 0, q0 * C * sizeof(T));                                  \
            if (sw == C)                                                        \
                memcpy(dr + q0 * C, src, (q1 - q0) * C * sizeof(T));            \
            else                                                                \
                for (ptrdiff_t q = q0; q < q1; q++)                             \
                    memcpy(dr + q * C, src + (q - q0) * sw, C * sizeof(T));     \
            memset(dr + q1 * C, 0, (nq - q1) * C * sizeof(T));                  \
        }                                                                       \
        for (ptrdiff_t p = 0; p < ld; p++) {                                    \
            T d0 = d[p], d1 = d[ld + p], d2 = d[2 * ld + p], d3 = d[3 * ld + p]; \
            t[p] = d0 - d2;                                                     \
            t[ld + p] = d1 + d2;                                                \
            t[2 * ld + p] = d2 - d1;                                            \
            t[3 * ld + p] = d1 - d3;                                            \
        }                                                                       \
        ptrdiff_t np = 2 * nt * C;                                              \
        for (int r = 0; r < 4; r++) {                                           \
            const T *tr = t + r * ld;                                           \
            T *vr = v + r * 4 * LDV;                                            \
            for (ptrdiff_t p = 0; p < np; p++) {                                \
                T a = tr[p], b = tr[p + C], e = tr[p + 2 * C], f = tr[p + 3 * C]; \
                vr[p] = a - e;                                                  \
                vr[LDV + p] = b + e;                                            \
                vr[2 * LDV + p] = e - b;                                        \
                vr[3 * LDV + p] = b - f;                                        \
            }                                                                   \
        }                                                                       \
    }                                                                           \
                                                                                \
    /* nt tiles of a chunk (V at v), one vector of output channels (its    \
       filters at u, bias its padded vector): output (i, j) of           \
       tile k at y + i*syh + (2k + j)*syw; rows (1 or 2) output rows, the \
       last tile cols (1 or 2) columns, lanes channels. */                 \
    static void fc_wino_thin_tiles_##SUFFIX(                                    \
        ptrdiff_t C, ptrdiff_t nt, const T *v, const T *u, T *y, ptrdiff_t syw, \
        ptrdiff_t syh, const T *bias, int act, int flags, int rows, int cols,   \
        int lanes)                                                              \
    {                                                                           \
        ptrdiff_t k = 0;                                                        \
        for (; k + FC_WINO_THIN_NT <= nt; k += FC_WINO_THIN_NT)                 \
            FC_WINO_THIN_CALL(SUFFIX, FC_WINO_THIN_NT);                         \
        if (FC_WINO_THIN_NT == 3 && nt - k == 2)                                \
            FC_WINO_THIN_CALL(SUFFIX, 2);                                       \
        else if (nt - k == 1)                                                   \
            FC_WINO_THIN_CALL(SUFFIX, 1);                                       \
    }

/* Tiles k.. by the NT kernel (2 only exists when FC_WINO_THIN_NT is 3;
 * the call is dead code otherwise). */
#if FC_WINO_THIN_NT == 3
#define FC_WINO_THIN_KERNEL(SUFFIX, NT) fc_wino_thin_##SUFFIX##_##NT
#else
#define FC_WINO_THIN_KERNEL(SUFFIX, NT) fc_wino_thin_##SUFFIX##_1
#endif
#define FC_WINO_THIN_CALL(SUFFIX, NT)                                           \
    FC_WINO_THIN_KERNEL(SUFFIX, NT)(C, v + 2 * C * k, u, y + 2 * k * syw, syw, \
                                    syh, bias, act, flags, rows,                \
                                    k + (NT) == nt ? cols : 2, lanes)

FC_DEFINE_WINO_THIN(f32, float)
FC_DEFINE_WINO_THIN(f64, double)

#endif
