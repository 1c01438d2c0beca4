/* Winograd F(4x4, 3x3) transforms, one source for every ISA build.
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

/* One step of the input transform: the 6x6 window of channels c..c+width
 * (V holds them) -> its 36 transformed values, point i at v + i*sv + c.
 * Rows r0..r1, columns s0..s1 of the window are inside the image; the
 * rest is the zero padding. */
#define FC_WINO_INPUT_STEP(T, V)                                                \
    {                                                                           \
        V d_[6][6], u_[6][6], col_[6], out_[6];                                 \
        FC_UNROLL for (int r = 0; r < 6; r++)                                   \
            FC_UNROLL for (int s = 0; s < 6; s++) {                             \
                if (r >= r0 && r < r1 && s >= s0 && s < s1)                     \
                    memcpy(&d_[r][s], img + (r - r0) * sh + (s - s0) * sw + c,      \
                           sizeof(V));    \
                else                                                            \
                    memset(&d_[r][s], 0, sizeof(V));                            \
            }                                                                   \
        FC_UNROLL for (int s = 0; s < 6; s++) {                                 \
            FC_UNROLL for (int r = 0; r < 6; r++) col_[r] = d_[r][s];           \
            FC_WINO_BT(T, col_, out_);                                          \
            FC_UNROLL for (int r = 0; r < 6; r++) u_[r][s] = out_[r];           \
        }                                                                       \
        FC_UNROLL for (int r = 0; r < 6; r++) {                                 \
            FC_WINO_BT(T, u_[r], out_);                                         \
            FC_UNROLL for (int s = 0; s < 6; s++)                               \
                memcpy(v + (r * 6 + s) * sv + c, &out_[s], sizeof(V));          \
        }                                                                       \
    }

/* The filter transform of one V of filters: tap t (row-major 3x3) of
 * them at w + t*ts -> their 36 values, point i at u + i*su. */
#define FC_WINO_STORE(u, v) memcpy((u), &(v), sizeof(v))
#define FC_WINO_FILTER_STEP(T, V) FC_WINO_FILTER_STEP_STORE(T, V, FC_WINO_STORE)
#define FC_WINO_FILTER_STEP_STORE(T, V, STORE)                                  \
    {                                                                           \
        V g_[3][3], t_[6][3], col_[3], out_[6];                                 \
        FC_UNROLL for (int r = 0; r < 3; r++)                                   \
            FC_UNROLL for (int s = 0; s < 3; s++)                               \
                memcpy(&g_[r][s], w + (r * 3 + s) * ts, sizeof(V));             \
        FC_UNROLL for (int s = 0; s < 3; s++) {                                 \
            FC_UNROLL for (int r = 0; r < 3; r++) col_[r] = g_[r][s];           \
            FC_WINO_G(T, col_, out_);                                           \
            FC_UNROLL for (int r = 0; r < 6; r++) t_[r][s] = out_[r];           \
        }                                                                       \
        FC_UNROLL for (int r = 0; r < 6; r++) {                                 \
            FC_WINO_G(T, t_[r], out_);                                          \
            FC_UNROLL for (int s = 0; s < 6; s++)                               \
                STORE(u + (r * 6 + s) * su, out_[s]);                           \
        }                                                                       \
    }

/* One step of the output transform: 36 products (point i at m + i*sm + k)
 * -> the 4x4 tile, + bias, + what y holds when add (a residual the caller
 * put there), activation, rows < rows and columns < cols stored at
 * y + r*syh + s*syw + k.  ACT(T, V, x) applies the activation. */
#define FC_WINO_OUTPUT_STEP(T, V, ACT)                                          \
    {                                                                           \
        V m_[6][6], t_[4][6], col_[6], out_[4], b_;                             \
        FC_UNROLL for (int r = 0; r < 6; r++)                                   \
            FC_UNROLL for (int s = 0; s < 6; s++)                               \
                memcpy(&m_[r][s], m + (r * 6 + s) * sm + k, sizeof(V));         \
        if (bias != NULL)                                                       \
            memcpy(&b_, bias + k, sizeof(V));                                   \
        else                                                                    \
            memset(&b_, 0, sizeof(V));                                          \
        FC_UNROLL for (int s = 0; s < 6; s++) {                                 \
            FC_UNROLL for (int r = 0; r < 6; r++) col_[r] = m_[r][s];           \
            FC_WINO_AT(T, col_, out_);                                          \
            FC_UNROLL for (int r = 0; r < 4; r++) t_[r][s] = out_[r];           \
        }                                                                       \
        FC_UNROLL for (int r = 0; r < 4; r++) {                                 \
            if (r >= rows) break;                                               \
            FC_WINO_AT(T, t_[r], out_);                                         \
            FC_UNROLL for (int s = 0; s < 4; s++) {                             \
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

#define FC_DEFINE_WINOGRAD(SUFFIX, T, ITYPE)                                    \
    typedef ITYPE fc_wino_mask_##SUFFIX __attribute__((vector_size(FC_VBYTES))); \
                                                                                \
    /* img points at pixel (r0, s0) of the window, the first inside the      \
       image. */                                                                \
    static inline void fc_wino_input_##SUFFIX(                                  \
        const T *img, ptrdiff_t sh, ptrdiff_t sw, int r0, int r1, int s0,       \
        int s1, ptrdiff_t C, T *restrict v, ptrdiff_t sv)                       \
    {                                                                           \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        ptrdiff_t c = 0;                                                        \
        for (; c + VL <= C; c += VL) FC_WINO_INPUT_STEP(T, fc_vec_##SUFFIX)     \
        for (; c < C; c++) FC_WINO_INPUT_STEP(T, T)                             \
    }                                                                           \
                                                                                \
    /* FC_VBYTES of filters (vectorised over output channels: w is the    \
       weight transposed to (tap, c, OC)), and one filter. */                   \
    static inline void fc_wino_filter_##SUFFIX(                                 \
        const T *w, ptrdiff_t ts, T *restrict u, ptrdiff_t su)                  \
    FC_WINO_FILTER_STEP(T, fc_vec_##SUFFIX)                                     \
                                                                                \
    /* The same with non-temporal stores, u vector-aligned: for filters   \
       far larger than the caches (36 x 512 x 512 floats: 38 MB per call),  \
       whose lines would be read for ownership, then evicted unread. */     \
    static inline void fc_wino_filter_nt_##SUFFIX(                              \
        const T *w, ptrdiff_t ts, T *restrict u, ptrdiff_t su)                  \
    FC_WINO_FILTER_STEP_STORE(T, fc_vec_##SUFFIX, FC_STREAM_##SUFFIX)           \
                                                                                \
    static inline void fc_wino_filter1_##SUFFIX(                                \
        const T *w, ptrdiff_t ts, T *restrict u, ptrdiff_t su)                  \
    FC_WINO_FILTER_STEP(T, T)                                                   \
                                                                                \
    static inline void fc_wino_output_##SUFFIX(                                 \
        const T *m, ptrdiff_t sm, ptrdiff_t K, const T *bias, int act, int add, \
        T *restrict y, ptrdiff_t syh, ptrdiff_t syw, int rows, int cols)        \
    {                                                                           \
        typedef fc_wino_mask_##SUFFIX fc_wino_mask_t;                           \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        ptrdiff_t k = 0;                                                        \
        for (; k + VL <= K; k += VL)                                            \
            FC_WINO_OUTPUT_STEP(T, fc_vec_##SUFFIX, FC_WINO_ACT_VECTOR)         \
        for (; k < K; k++) FC_WINO_OUTPUT_STEP(T, T, FC_WINO_ACT_SCALAR)        \
    }

FC_DEFINE_WINOGRAD(f32, float, int32_t)
FC_DEFINE_WINOGRAD(f64, double, int64_t)

#endif
