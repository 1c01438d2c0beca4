/* Winograd F(4x4, 3x3) and F(2x2, 3x3) transforms, one source for every
 * ISA build.
 *
 * A 4x4 output tile of a 3x3 stride-1 convolution is
 *     Y = A^T [ sum_c (G g_c G^T) . (B^T d_c B) ] A
 * for its 6x6 input window d_c and filter g_c of each input channel c: 36
 * multiplications per (input, output) channel pair instead of 4*4*9 = 144.
 * Summed over c, the 36 element-wise products are 36 ordinary GEMMs
 * (tiles x C) @ (C x K), which fastconv's GEMM micro-kernel does; this
 * header has the three transforms around them.  Each works on FC_VBYTES of
 * channels at once (NHWC keeps a pixel's channels contiguous) and on one
 * channel at a time for the tail, from one body instantiated for both.
 *
 * Interpolation points 0, +-3/2, +-2/3 and infinity, not Lavin & Gray's
 * 0, +-1, +-2: among ~3,000 point sets tried in a float32 simulation they
 * gave the smallest error, 2-3x below the usual set's (measured on the
 * real kernels: benchmarks/README.md, "Winograd"), and keep its symmetry
 * (rows in +- pairs that share partial sums).  The 1-D transforms are the
 * matrices' rows written out (multiplying by their zeros would not fold
 * away without -ffast-math); G's entries (8/65, -81/130, ...) are rounded
 * to T, so U = G g G^T differs from exact by one rounding per term.
 *
 * Requires micro_kernel.h first (FC_VBYTES, FC_UNROLL, fc_vec_f32/f64).
 */
#ifndef FASTCONV_WINOGRAD_KERNEL_H
#define FASTCONV_WINOGRAD_KERNEL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* r[0..5] = B^T d[0..5] */
#define FC_WINO_BT(T, d, r)                                                     \
    do {                                                                        \
        __typeof__(d[0]) a_ = d[4] - (T)(4.0 / 9) * d[2];                       \
        __typeof__(d[0]) b_ = (T)1.5 * d[3] - (T)(2.0 / 3) * d[1];              \
        __typeof__(d[0]) c_ = d[4] - (T)2.25 * d[2];                            \
        __typeof__(d[0]) e_ = (T)(2.0 / 3) * d[3] - (T)1.5 * d[1];              \
        r[0] = d[0] - (T)(97.0 / 36) * d[2] + d[4];                             \
        r[1] = a_ + b_;                                                         \
        r[2] = a_ - b_;                                                         \
        r[3] = c_ + e_;                                                         \
        r[4] = c_ - e_;                                                         \
        r[5] = d[1] - (T)(97.0 / 36) * d[3] + d[5];                             \
    } while (0)

/* r[0..5] = G g[0..2] */
#define FC_WINO_G(T, g, r)                                                      \
    do {                                                                        \
        __typeof__(g[0]) a_ = (T)(8.0 / 65) * g[0] + (T)(18.0 / 65) * g[2];     \
        __typeof__(g[0]) b_ = (T)(12.0 / 65) * g[1];                            \
        __typeof__(g[0]) c_ = (T)(-81.0 / 130) * g[0] - (T)(18.0 / 65) * g[2];  \
        __typeof__(g[0]) e_ = (T)(27.0 / 65) * g[1];                            \
        r[0] = g[0];                                                            \
        r[1] = a_ + b_;                                                         \
        r[2] = a_ - b_;                                                         \
        r[3] = c_ - e_;                                                         \
        r[4] = c_ + e_;                                                         \
        r[5] = g[2];                                                            \
    } while (0)

/* r[0..3] = A^T m[0..5] */
#define FC_WINO_AT(T, m, r)                                                     \
    do {                                                                        \
        __typeof__(m[0]) s12_ = m[1] + m[2], d12_ = m[1] - m[2];                \
        __typeof__(m[0]) s34_ = m[3] + m[4], d34_ = m[3] - m[4];                \
        r[0] = m[0] + s12_ + s34_;                                              \
        r[1] = (T)1.5 * d12_ + (T)(2.0 / 3) * d34_;                             \
        r[2] = (T)2.25 * s12_ + (T)(4.0 / 9) * s34_;                            \
        r[3] = (T)3.375 * d12_ + (T)(8.0 / 27) * d34_ + m[5];                   \
    } while (0)

/* F(2x2, 3x3), Lavin & Gray's points 0, +-1 (and infinity): 16
 * multiplications per channel pair, for layers with few tiles, where the
 * 36 x C x OC transformed filters of F(4x4) are most of the memory traffic
 * (7x7 at batch 1: 38 MB for 512 channels, 16.8 MB here).  Its rounding
 * error is about the direct method's.  r[0..3] = B^T d[0..3] */
#define FC_WINO2_BT(T, d, r)                                                    \
    do {                                                                        \
        r[0] = d[0] - d[2];                                                     \
        r[1] = d[1] + d[2];                                                     \
        r[2] = d[2] - d[1];                                                     \
        r[3] = d[1] - d[3];                                                     \
    } while (0)

/* r[0..3] = G g[0..2] */
#define FC_WINO2_G(T, g, r)                                                     \
    do {                                                                        \
        __typeof__(g[0]) h_ = (T)0.5 * (g[0] + g[2]);                           \
        r[0] = g[0];                                                            \
        r[1] = h_ + (T)0.5 * g[1];                                              \
        r[2] = h_ - (T)0.5 * g[1];                                              \
        r[3] = g[2];                                                            \
    } while (0)

/* r[0..1] = A^T m[0..3] */
#define FC_WINO2_AT(T, m, r)                                                    \
    do {                                                                        \
        r[0] = m[0] + m[1] + m[2];                                              \
        r[1] = m[1] - m[2] - m[3];                                              \
    } while (0)

/* One step of the input transform: the AxA window (A = 6 for F(4x4), 4
 * for F(2x2); BT its 1-D transform) of channels c..c+width (V holds them)
 * -> its A*A transformed values, point i at v + i*sv + c.  Rows r0..r1,
 * columns s0..s1 of the window are inside the image; the rest is the zero
 * padding. */
#define FC_WINO_INPUT_STEP(T, V, A, BT)                                         \
    {                                                                           \
        V d_[A][A], u_[A][A], col_[A], out_[A];                                 \
        FC_UNROLL for (int r = 0; r < (A); r++)                                 \
            FC_UNROLL for (int s = 0; s < (A); s++) {                           \
                if (r >= r0 && r < r1 && s >= s0 && s < s1)                     \
                    memcpy(&d_[r][s], img + (r - r0) * sh + (s - s0) * sw + c,  \
                           sizeof(V));                                          \
                else                                                            \
                    memset(&d_[r][s], 0, sizeof(V));                            \
            }                                                                   \
        FC_UNROLL for (int s = 0; s < (A); s++) {                               \
            FC_UNROLL for (int r = 0; r < (A); r++) col_[r] = d_[r][s];         \
            BT(T, col_, out_);                                                  \
            FC_UNROLL for (int r = 0; r < (A); r++) u_[r][s] = out_[r];         \
        }                                                                       \
        FC_UNROLL for (int r = 0; r < (A); r++) {                               \
            BT(T, u_[r], out_);                                                 \
            FC_UNROLL for (int s = 0; s < (A); s++)                             \
                memcpy(v + (r * (A) + s) * sv + c, &out_[s], sizeof(V));        \
        }                                                                       \
    }

/* The filter transform of one V of filters: tap t (row-major 3x3) of
 * them at w + t*ts -> their A*A values (G the 1-D transform), point i at
 * u + i*su. */
#define FC_WINO_STORE(u, v) memcpy((u), &(v), sizeof(v))
#define FC_WINO_FILTER_STEP(T, V, A, G, STORE)                                  \
    {                                                                           \
        V g_[3][3], t_[A][3], col_[3], out_[A];                                 \
        FC_UNROLL for (int r = 0; r < 3; r++)                                   \
            FC_UNROLL for (int s = 0; s < 3; s++)                               \
                memcpy(&g_[r][s], w + (r * 3 + s) * ts, sizeof(V));             \
        FC_UNROLL for (int s = 0; s < 3; s++) {                                 \
            FC_UNROLL for (int r = 0; r < 3; r++) col_[r] = g_[r][s];           \
            G(T, col_, out_);                                                   \
            FC_UNROLL for (int r = 0; r < (A); r++) t_[r][s] = out_[r];         \
        }                                                                       \
        FC_UNROLL for (int r = 0; r < (A); r++) {                               \
            G(T, t_[r], out_);                                                  \
            FC_UNROLL for (int s = 0; s < (A); s++)                             \
                STORE(u + (r * (A) + s) * su, out_[s]);                         \
        }                                                                       \
    }

/* One step of the output transform: A*A products (point i at m + i*sm +
 * k) -> the MxM tile (AT the 1-D transform), + bias, + what y holds when
 * add (a residual the caller put there), activation, rows < rows and
 * columns < cols stored at y + r*syh + s*syw + k.  ACT(T, V, x) applies
 * the activation. */
#define FC_WINO_OUTPUT_STEP(T, V, A, M, AT, ACT)                                \
    {                                                                           \
        V m_[A][A], t_[M][A], col_[A], out_[M], b_;                             \
        FC_UNROLL for (int r = 0; r < (A); r++)                                 \
            FC_UNROLL for (int s = 0; s < (A); s++)                             \
                memcpy(&m_[r][s], m + (r * (A) + s) * sm + k, sizeof(V));       \
        if (bias != NULL)                                                       \
            memcpy(&b_, bias + k, sizeof(V));                                   \
        else                                                                    \
            memset(&b_, 0, sizeof(V));                                          \
        FC_UNROLL for (int s = 0; s < (A); s++) {                               \
            FC_UNROLL for (int r = 0; r < (A); r++) col_[r] = m_[r][s];         \
            AT(T, col_, out_);                                                  \
            FC_UNROLL for (int r = 0; r < (M); r++) t_[r][s] = out_[r];         \
        }                                                                       \
        FC_UNROLL for (int r = 0; r < (M); r++) {                               \
            if (r >= rows) break;                                               \
            AT(T, t_[r], out_);                                                 \
            FC_UNROLL for (int s = 0; s < (M); s++) {                           \
                if (s >= cols) break;                                           \
                V o_ = out_[s] + b_, r_;                                        \
                if (add) {                                                      \
                    memcpy(&r_, y + r * syh + s * syw + k, sizeof(V));          \
                    o_ = o_ + r_;                                               \
                }                                                               \
                ACT(T, V, o_);                                                  \
                memcpy(y + r * syh + s * syw + k, &o_, sizeof(V));              \
            }                                                                   \
        }                                                                       \
    }

/* relu: x < 0 -> 0; relu6: then x > 6 -> 6.  NaN stays NaN, as in torch
 * (and in the GEMM epilogue).  Vectors select through integer masks (C has
 * no vector ?:). */
#define FC_WINO_ACT_SCALAR(T, V, x)                                                \
    do {                                                                        \
        if (act != 0 && x < 0) x = 0;                                           \
        if (act == 2 && x > 6) x = 6;                                           \
    } while (0)

#define FC_WINO_ACT_VECTOR(T, V, x)                                                \
    do {                                                                        \
        if (act != 0) {                                                         \
            fc_wino_mask_t neg_ = x < (V){0};                                   \
            fc_wino_mask_t bits_;                                               \
            memcpy(&bits_, &x, sizeof(V));                                      \
            bits_ &= ~neg_;                                                     \
            memcpy(&x, &bits_, sizeof(V));                                      \
        }                                                                       \
        if (act == 2) {                                                         \
            V six_ = (V){0} + (T)6;                                                 \
            fc_wino_mask_t big_ = x > six_, bits_, sixb_;                       \
            memcpy(&bits_, &x, sizeof(V));                                      \
            memcpy(&sixb_, &six_, sizeof(V));                                   \
            bits_ = (bits_ & ~big_) | (sixb_ & big_);                           \
            memcpy(&x, &bits_, sizeof(V));                                      \
        }                                                                       \
    } while (0)

/* The three transforms of one variant: PRE is fc_wino (F(4x4)) or
 * fc_wino2 (F(2x2)), A its window, M its tile, BT/G/AT its 1-D transforms. */
#define FC_DEFINE_WINOGRAD_VARIANT(PRE, SUFFIX, T, A, M, BT, G, AT)             \
    /* img points at pixel (r0, s0) of the window, the first inside the      \
       image. */                                                                \
    static inline void PRE##_input_##SUFFIX(                                    \
        const T *img, ptrdiff_t sh, ptrdiff_t sw, int r0, int r1, int s0,       \
        int s1, ptrdiff_t C, T *restrict v, ptrdiff_t sv)                       \
    {                                                                           \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        ptrdiff_t c = 0;                                                        \
        for (; c + VL <= C; c += VL)                                            \
            FC_WINO_INPUT_STEP(T, fc_vec_##SUFFIX, A, BT)                       \
        for (; c < C; c++) FC_WINO_INPUT_STEP(T, T, A, BT)                      \
    }                                                                           \
                                                                                \
    /* FC_VBYTES of filters (vectorised over output channels: w is the    \
       weight transposed to (tap, c, OC)), and one filter. */                   \
    static inline void PRE##_filter_##SUFFIX(                                   \
        const T *w, ptrdiff_t ts, T *restrict u, ptrdiff_t su)                  \
    FC_WINO_FILTER_STEP(T, fc_vec_##SUFFIX, A, G, FC_WINO_STORE)                \
                                                                                \
    /* The same with non-temporal stores, u vector-aligned: for filters   \
       far larger than the caches (36 x 512 x 512 floats: 38 MB per call),  \
       whose lines would be read for ownership, then evicted unread. */     \
    static inline void PRE##_filter_nt_##SUFFIX(                                \
        const T *w, ptrdiff_t ts, T *restrict u, ptrdiff_t su)                  \
    FC_WINO_FILTER_STEP(T, fc_vec_##SUFFIX, A, G, FC_STREAM_##SUFFIX)           \
                                                                                \
    static inline void PRE##_filter1_##SUFFIX(                                  \
        const T *w, ptrdiff_t ts, T *restrict u, ptrdiff_t su)                  \
    FC_WINO_FILTER_STEP(T, T, A, G, FC_WINO_STORE)                              \
                                                                                \
    static inline void PRE##_output_##SUFFIX(                                   \
        const T *m, ptrdiff_t sm, ptrdiff_t K, const T *bias, int act, int add, \
        T *restrict y, ptrdiff_t syh, ptrdiff_t syw, int rows, int cols)        \
    {                                                                           \
        typedef fc_wino_mask_##SUFFIX fc_wino_mask_t;                           \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        ptrdiff_t k = 0;                                                        \
        for (; k + VL <= K; k += VL)                                            \
            FC_WINO_OUTPUT_STEP(T, fc_vec_##SUFFIX, A, M, AT, FC_WINO_ACT_VECTOR) \
        for (; k < K; k++) FC_WINO_OUTPUT_STEP(T, T, A, M, AT, FC_WINO_ACT_SCALAR) \
    }

/* F(4x4) for few tiles with filters transformed per call (a 7x7 image at
 * batch 1 has 4): each point of U would be used by that few rows of V
 * only, so it is never stored; each row of points is finished in
 * registers next to the products that use it, once per group of
 * FC_WINO_FEW_TILES tiles.
 *
 * Its transform is G factored as S H Lam, where each factor has a job:
 * - S = diag(fc_wino_few_scale), G's rows' leading entries (and 4/9 for
 *   the last): U . V = (H g' H^T) . (S V S), so S moves to V, scaled
 *   once per tile where U is made once per channel pair;
 * - Lam = diag(1, 3/2, 9/4) scales the filter's rows and columns, g' =
 *   Lam g Lam: one multiply a tap, folded into the transposes that bring
 *   the taps in;
 * - which leaves H's rows 1 and 2, (1, +-1, 1), additions only.
 * H's other multiplies are kept apart from their additions
 * (FC_WINO_NO_CONTRACT), so that the FMA pipes carry the products and the
 * adders work beside them.  Measured in a harness (512->512 @7 batch 1, 2
 * threads, Zen 4): the products from raw taps 0.49 ms with G's rows scaled
 * to a leading 1 (three FMAs a +- pair), 0.45 with their multiplies kept
 * apart, 0.39 by H; the transposes and products together 0.67 ms with the
 * column halves stored in every call (as fc_wino_gcols_rows now stores
 * them for prepacked filters), 0.56 from raw taps by H.
 *
 * fc_wino_scale_vt: S V S, for n channels of row i of a group's V as
 * fc_wino_few reads it (below).
 * fc_wino_taps: the scaled taps g' of n input channels of VL output
 * channels (tap t of channel c at w + c*tc + t*ts, the output channels
 * contiguous) to wl + (c*9 + t)*VL (wl may be w, scaled in place).
 * fc_wino_taps_rows: the same from VL rows of a (OC x 9*C) OHWI weight
 * (channel c of tap t of row o at w + o*rsw + t*C + c), transposed through
 * registers a square at a time.
 * fc_wino_gcols_rows: the column halves H g' (6 x 3 per filter) of those
 * rows: row i, column s of channel c at tb + i*ldi + (c*3 + s)*VL, for
 * prepacked filters (the same values fc_wino_few computes from the taps).
 * fc_wino_few: row i's six points (one 1-D transform of the row's column
 * half) times the S V S of FC_WINO_FEW_TILES tiles, n channels: point
 * (i, j) of tile q, for channel c at vt[c*6*Q + j*Q + q] (a channel's 24
 * values contiguous, so that one pointer walks them all: 24 row pointers
 * ran out of registers and reloaded their offsets from the stack), added
 * into m[j*sm + q*ldm] when add, else stored there.  The column half comes
 * from src: with taps, the scaled taps (fc_wino_taps*), row i's half made
 * in registers (per call no halves are stored: their 18 stores a channel
 * took longer than the three additions or FMAs a row makes); else row i's
 * packed halves (fc_wino_gcols_rows). */
enum { FC_WINO_FEW_TILES = 4 };
static const double fc_wino_few_scale[6] = {1.0, 8.0 / 65, 8.0 / 65, -81.0 / 130,
                                            -81.0 / 130, 4.0 / 9};
static const double fc_wino_few_lam[3] = {1.0, 1.5, 2.25};

/* Keeps x a value of its own: GCC otherwise fuses a multiply used by two
 * additions into two FMAs. */
#if defined(__x86_64__) || defined(__i386__)
#define FC_WINO_NO_CONTRACT(x) __asm__("" : "+v"(x))
#elif defined(__aarch64__)
#define FC_WINO_NO_CONTRACT(x) __asm__("" : "+w"(x))
#else
#define FC_WINO_NO_CONTRACT(x) ((void)0)
#endif

/* r = row i (a constant) of H times g[0..2]: H = (1 0 0; 1 1 1; 1 -1 1;
 * 1 4/9 16/81; 1 -4/9 16/81; 0 0 1). */
#define FC_WINO_FEW_ROW(T, i, g0, g1, g2, r)                                    \
    do {                                                                        \
        if ((i) == 0) r = (g0);                                                 \
        else if ((i) == 5) r = (g2);                                            \
        else if ((i) == 1) r = ((g0) + (g2)) + (g1);                            \
        else if ((i) == 2) r = ((g0) + (g2)) - (g1);                            \
        else {                                                                  \
            __typeof__(r) a_ = (g0) + (T)(16.0 / 81) * (g2);                    \
            __typeof__(r) e_ = (T)(4.0 / 9) * (g1);                             \
            FC_WINO_NO_CONTRACT(e_);                                            \
            r = (i) == 3 ? a_ + e_ : a_ - e_;                                   \
        }                                                                       \
    } while (0)

#define FC_WINO_FEW_H(T, g, r)                                                  \
    do {                                                                        \
        FC_UNROLL for (int h_ = 0; h_ < 6; h_++)                                \
            FC_WINO_FEW_ROW(T, h_, g[0], g[1], g[2], r[h_]);                    \
    } while (0)

#define FC_DEFINE_WINOGRAD_FEW(SUFFIX, T)                                       \
    static void fc_wino_scale_vt_##SUFFIX(ptrdiff_t n, int i, T *vt)            \
    {                                                                           \
        enum { Q = FC_WINO_FEW_TILES };                                         \
        T s_[6 * Q];                                                            \
        for (int j = 0; j < 6 * Q; j++)                                         \
            s_[j] = (T)(fc_wino_few_scale[i] * fc_wino_few_scale[j / Q]);       \
        for (ptrdiff_t c = 0; c < n; c++)                                       \
            FC_UNROLL for (int j = 0; j < 6 * Q; j++) vt[c * 6 * Q + j] *= s_[j]; \
    }                                                                           \
                                                                                \
    static void fc_wino_taps_##SUFFIX(ptrdiff_t n, const T *w, ptrdiff_t ts,    \
                                      ptrdiff_t tc, T *wl)                      \
    {                                                                           \
        typedef fc_vec_##SUFFIX V;                                              \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        for (ptrdiff_t c = 0; c < n; c++)                                       \
            FC_UNROLL for (int t = 0; t < 9; t++) {                             \
                V g_;                                                           \
                memcpy(&g_, w + c * tc + t * ts, sizeof(V));                    \
                g_ *= (T)(fc_wino_few_lam[t / 3] * fc_wino_few_lam[t % 3]);     \
                memcpy(wl + (c * 9 + t) * VL, &g_, sizeof(V));                  \
            }                                                                   \
    }                                                                           \
                                                                                \
    static void fc_wino_taps_rows_##SUFFIX(ptrdiff_t n, const T *w,             \
                                           ptrdiff_t rsw, ptrdiff_t C,          \
                                           T *restrict wl)                      \
    {                                                                           \
        enum { VL = FC_VBYTES / sizeof(T), TB = FC_TB_##SUFFIX };               \
        if (n >= TB && VL == TB) {                                              \
            /* Straight from the rows, 32-byte squares in registers, blocks  \
               of TB channels on cache lines: the first block, then from    \
               the first line boundary on, the last block ending at n (the  \
               overlaps write the same taps twice).  Not unrolled: a        \
               block's 36 squares as one stretch of code took 0.18 ms in a  \
               harness (512->512's taps, 2 threads), as loops 0.134. */     \
            enum { SQ = 32 / sizeof(T) };                                       \
            ptrdiff_t head = (TB - (ptrdiff_t)((uintptr_t)w / sizeof(T) % TB)) % TB; \
            for (ptrdiff_t c0 = 0;; c0 = c0 == 0 && head ? head : c0 + TB) {    \
                ptrdiff_t s = c0 + TB <= n ? c0 : n - TB;                       \
                for (int t = 0; t < 9; t++)                                     \
                    for (int o = 0; o < VL; o += SQ)                            \
                        for (int q = 0; q < TB; q += SQ)                        \
                            fc_transpose_sq_##SUFFIX(                           \
                                w + o * rsw + t * C + s + q, rsw,               \
                                wl + ((s + q) * 9 + t) * VL + o, 9 * VL,        \
                                (T)(fc_wino_few_lam[t / 3] * fc_wino_few_lam[t % 3])); \
                if (s + TB >= n) return;                                        \
            }                                                                   \
        }                                                                       \
        for (ptrdiff_t c0 = 0; c0 < n; c0 += TB) {                              \
            ptrdiff_t nc = n - c0 < TB ? n - c0 : TB;                           \
            for (int t = 0; t < 9; t++)   /* VL <= TB: one block a tap */       \
                fc_transpose_block_##SUFFIX(0, VL, 0, nc, w + t * C + c0, rsw,  \
                                            wl + (c0 * 9 + t) * VL, 9 * VL);    \
            /* ...then scaled in place. */                                      \
            fc_wino_taps_##SUFFIX(nc, wl + c0 * 9 * VL, VL, 9 * VL, wl + c0 * 9 * VL); \
        }                                                                       \
    }                                                                           \
                                                                                \
    static void fc_wino_gcols_rows_##SUFFIX(                                    \
        ptrdiff_t n, const T *w, ptrdiff_t rsw, ptrdiff_t C, T *restrict tb,    \
        ptrdiff_t ldi)                                                          \
    {                                                                           \
        typedef fc_vec_##SUFFIX V;                                              \
        enum { VL = FC_VBYTES / sizeof(T), TB = FC_TB_##SUFFIX };               \
        T wl[9 * TB * VL] __attribute__((aligned(64)));                         \
        for (ptrdiff_t c0 = 0; c0 < n; c0 += TB) {                              \
            ptrdiff_t nc = n - c0 < TB ? n - c0 : TB;                           \
            fc_wino_taps_rows_##SUFFIX(nc, w + c0, rsw, C, wl);                 \
            for (ptrdiff_t c = 0; c < nc; c++)                                  \
                FC_UNROLL for (int s = 0; s < 3; s++) {                         \
                    V g_[3], out_[6];                                           \
                    FC_UNROLL for (int r = 0; r < 3; r++)                       \
                        memcpy(&g_[r], wl + (c * 9 + r * 3 + s) * VL, sizeof(V)); \
                    FC_WINO_FEW_H(T, g_, out_);                                 \
                    FC_UNROLL for (int i = 0; i < 6; i++)                       \
                        memcpy(tb + i * ldi + ((c0 + c) * 3 + s) * VL, &out_[i], \
                               sizeof(V));                                      \
                }                                                               \
        }                                                                       \
    }                                                                           \
                                                                                \
    /* Row i (a constant) of points for n channels: from the scaled taps at   \
       src (taps) or the column halves (not taps). */                          \
    static inline __attribute__((always_inline)) void fc_wino_few_row_##SUFFIX( \
        const int i, const int taps, ptrdiff_t n, const T *src, const T *vt,    \
        T *m, ptrdiff_t sm, ptrdiff_t ldm, int add)                             \
    {                                                                           \
        typedef fc_vec_##SUFFIX V;                                              \
        enum { VL = FC_VBYTES / sizeof(T), Q = FC_WINO_FEW_TILES };             \
        V acc[6][Q];                                                            \
        FC_UNROLL for (int j = 0; j < 6; j++)                                   \
            FC_UNROLL for (int q = 0; q < Q; q++) acc[j][q] = (V){0};           \
        for (ptrdiff_t c = 0; c < n; c++) {                                     \
            V t_[3], u_[6];                                                     \
            FC_UNROLL for (int s = 0; s < 3; s++) {                             \
                if (taps) {                                                     \
                    V g0_, g1_, g2_;                                            \
                    memcpy(&g0_, src + (c * 9 + s) * VL, sizeof(V));            \
                    memcpy(&g1_, src + (c * 9 + 3 + s) * VL, sizeof(V));        \
                    memcpy(&g2_, src + (c * 9 + 6 + s) * VL, sizeof(V));        \
                    FC_WINO_FEW_ROW(T, i, g0_, g1_, g2_, t_[s]);                \
                } else                                                          \
                    memcpy(&t_[s], src + (c * 3 + s) * VL, sizeof(V));          \
            }                                                                   \
            FC_WINO_FEW_H(T, t_, u_);                                           \
            FC_UNROLL for (int j = 0; j < 6; j++)                               \
                FC_UNROLL for (int q = 0; q < Q; q++) {                         \
                    T x_;                                                       \
                    memcpy(&x_, vt + c * 6 * Q + j * Q + q, sizeof(T));         \
                    acc[j][q] += x_ * u_[j];                                    \
                }                                                               \
        }                                                                       \
        /* A k-block's sum is added to M's, not M carried through it: the    \
           blocked sum's smaller rounding error (2-3x, C = 512). */            \
        FC_UNROLL for (int j = 0; j < 6; j++)                                   \
            FC_UNROLL for (int q = 0; q < Q; q++) {                             \
                if (add) {                                                      \
                    V o_;                                                       \
                    memcpy(&o_, m + j * sm + q * ldm, sizeof(V));               \
                    acc[j][q] += o_;                                            \
                }                                                               \
                memcpy(m + j * sm + q * ldm, &acc[j][q], sizeof(V));            \
            }                                                                   \
    }                                                                           \
                                                                                \
    static void fc_wino_few_##SUFFIX(int i, int taps, ptrdiff_t n, const T *src, \
                                     const T *vt, T *m, ptrdiff_t sm,           \
                                     ptrdiff_t ldm, int add)                    \
    {                                                                           \
        if (!taps) {    /* the row's halves: no row-specific code */            \
            fc_wino_few_row_##SUFFIX(0, 0, n, src, vt, m, sm, ldm, add);        \
            return;                                                             \
        }                                                                       \
        switch (i) {                                                            \
        case 0: fc_wino_few_row_##SUFFIX(0, 1, n, src, vt, m, sm, ldm, add); break; \
        case 1: fc_wino_few_row_##SUFFIX(1, 1, n, src, vt, m, sm, ldm, add); break; \
        case 2: fc_wino_few_row_##SUFFIX(2, 1, n, src, vt, m, sm, ldm, add); break; \
        case 3: fc_wino_few_row_##SUFFIX(3, 1, n, src, vt, m, sm, ldm, add); break; \
        case 4: fc_wino_few_row_##SUFFIX(4, 1, n, src, vt, m, sm, ldm, add); break; \
        default: fc_wino_few_row_##SUFFIX(5, 1, n, src, vt, m, sm, ldm, add);   \
        }                                                                       \
    }

#define FC_DEFINE_WINOGRAD(SUFFIX, T, ITYPE)                                    \
    typedef ITYPE fc_wino_mask_##SUFFIX __attribute__((vector_size(FC_VBYTES))); \
    FC_DEFINE_WINOGRAD_VARIANT(fc_wino, SUFFIX, T, 6, 4, FC_WINO_BT, FC_WINO_G, \
                               FC_WINO_AT)                                      \
    FC_DEFINE_WINOGRAD_FEW(SUFFIX, T)                                           \
    FC_DEFINE_WINOGRAD_VARIANT(fc_wino2, SUFFIX, T, 4, 2, FC_WINO2_BT,          \
                               FC_WINO2_G, FC_WINO2_AT)

FC_DEFINE_WINOGRAD(f32, float, int32_t)
FC_DEFINE_WINOGRAD(f64, double, int64_t)

#endif
