/* The depthwise inner kernel, one source for every ISA build (FC_VBYTES is
 * defined by the including module, as for micro_kernel.h).
 *
 * y[c] = bias[c] + sum_t a[t][c] * b[t][c] for c < C: one output pixel of a
 * depthwise convolution (a = the input pixels under the valid taps, b = those
 * taps' weights), or one input pixel of its data gradient (a = output
 * gradients, b = weights).  Channels are the vector axis; four vectors of
 * channels stay in registers across all taps, so each output is stored once
 * instead of read and written back per tap (measured 4x slower that way).
 */
#ifndef FASTCONV_DEPTHWISE_KERNEL_H
#define FASTCONV_DEPTHWISE_KERNEL_H

#include <stddef.h>
#include <string.h>

#if defined(__clang__)
#define FC_DW_UNROLL _Pragma("clang loop unroll(full)")
#else
#define FC_DW_UNROLL _Pragma("GCC unroll 16")
#endif

#define FC_DEFINE_DEPTHWISE_TAPS(SUFFIX, T)                                      \
    typedef T fc_dwvec_##SUFFIX __attribute__((vector_size(FC_VBYTES)));        \
    static inline void fc_depthwise_taps_##SUFFIX(                              \
        ptrdiff_t C, ptrdiff_t ntaps, const T *const *a, const T *const *b,     \
        const T *bias, T *y)                                                    \
    {                                                                           \
        typedef fc_dwvec_##SUFFIX vec;                                          \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        ptrdiff_t c = 0;                                                        \
        for (; c + 4 * VL <= C; c += 4 * VL) {                                  \
            vec acc[4], va, vb;                                                 \
            for (int v = 0; v < 4; v++) {                                       \
                acc[v] = (vec){0};                                              \
                if (bias) memcpy(&acc[v], bias + c + v * VL, FC_VBYTES);        \
            }                                                                   \
            for (ptrdiff_t t = 0; t < ntaps; t++) {                             \
                for (int v = 0; v < 4; v++) {                                   \
                    memcpy(&va, a[t] + c + v * VL, FC_VBYTES);                  \
                    memcpy(&vb, b[t] + c + v * VL, FC_VBYTES);                  \
                    acc[v] += va * vb;                                          \
                }                                                               \
            }                                                                   \
            for (int v = 0; v < 4; v++)                                         \
                memcpy(y + c + v * VL, &acc[v], FC_VBYTES);                     \
        }                                                                       \
        for (; c + VL <= C; c += VL) {                                          \
            vec acc = (vec){0}, va, vb;                                         \
            if (bias) memcpy(&acc, bias + c, FC_VBYTES);                        \
            for (ptrdiff_t t = 0; t < ntaps; t++) {                             \
                memcpy(&va, a[t] + c, FC_VBYTES);                               \
                memcpy(&vb, b[t] + c, FC_VBYTES);                               \
                acc += va * vb;                                                 \
            }                                                                   \
            memcpy(y + c, &acc, FC_VBYTES);                                     \
        }                                                                       \
        for (; c < C; c++) {                                                    \
            T acc = bias ? bias[c] : 0;                                         \
            for (ptrdiff_t t = 0; t < ntaps; t++)                               \
                acc += a[t][c] * b[t][c];                                       \
            y[c] = acc;                                                         \
        }                                                                       \
    }

/* One output row of a 3x3 depthwise convolution, multiplier 1: channel
 * vectors outer, pixels inner, so a vector's 9 weights stay in registers
 * while the row's pixels stream past and every FMA loads only its input
 * (the per-pixel kernel above reloads the weights for each pixel: 2 loads
 * per FMA, and a list of tap pointers built per pixel).  rows[kh] is input
 * row oh*SH - PT + kh*DH of the image (NULL when outside it); pixels
 * ow in [lo, hi) have all three columns inside the image and skip the
 * column checks.  y: the output row, pixels C apart. */
#define FC_DW3_FOR_TAPS(V, CHECK, BODY)                                         \
    /* For each tap t of pixel ow inside the image: xv = its input; BODY. */    \
    {                                                                           \
        ptrdiff_t iw0 = ow * SW - PL;                                           \
        V xv;                                                                   \
        FC_DW_UNROLL for (int kh = 0; kh < 3; kh++) {                           \
            if (rows[kh] == NULL) continue;                                     \
            FC_DW_UNROLL for (int kw = 0; kw < 3; kw++) {                       \
                ptrdiff_t iw = iw0 + kw * DW;                                   \
                const int t = kh * 3 + kw;                                      \
                if (CHECK && (iw < 0 || iw >= W)) continue;                     \
                memcpy(&xv, rows[kh] + iw * xsw + c, sizeof(V));                \
                BODY                                                            \
            }                                                                   \
        }                                                                       \
    }

#define FC_DW3_PIXEL(T, V, CHECK)                                               \
    {                                                                           \
        V acc = bv;                                                             \
        FC_DW3_FOR_TAPS(V, CHECK, acc += xv * wv[t];)                           \
        memcpy(y + ow * C + c, &acc, sizeof(V));                                \
    }

#define FC_DW3_STEP(T, V)                                                       \
    {                                                                           \
        V wv[9], bv;                                                            \
        FC_DW_UNROLL for (int t = 0; t < 9; t++)                                \
            memcpy(&wv[t], w + t * C + c, sizeof(V));                           \
        if (bias) memcpy(&bv, bias + c, sizeof(V));                             \
        else memset(&bv, 0, sizeof(V));                                         \
        ptrdiff_t ow = 0;                                                       \
        for (; ow < lo; ow++) FC_DW3_PIXEL(T, V, 1)                             \
        for (; ow < hi; ow++) FC_DW3_PIXEL(T, V, 0)                             \
        for (; ow < OW; ow++) FC_DW3_PIXEL(T, V, 1)                             \
    }

/* The weight gradient of one output row of the same layer: for each
 * channel vector, the 9 taps' sums over the row's pixels stay in registers
 * (acc[t] += x under tap t * dy), added into the thread's partial dw
 * (taps (3, 3, C)) once per row instead of per pixel.  dy: the row's output
 * gradients, pixels C apart. */
#define FC_DW3_GRADW_PIXEL(T, V, CHECK)                                         \
    {                                                                           \
        V dv;                                                                   \
        memcpy(&dv, dy + ow * C + c, sizeof(V));                                \
        FC_DW3_FOR_TAPS(V, CHECK, acc[t] += xv * dv;)                           \
    }

#define FC_DW3_GRADW_STEP(T, V)                                                 \
    {                                                                           \
        V acc[9], sum;                                                          \
        FC_DW_UNROLL for (int t = 0; t < 9; t++) memset(&acc[t], 0, sizeof(V)); \
        ptrdiff_t ow = 0;                                                       \
        for (; ow < lo; ow++) FC_DW3_GRADW_PIXEL(T, V, 1)                       \
        for (; ow < hi; ow++) FC_DW3_GRADW_PIXEL(T, V, 0)                       \
        for (; ow < OW; ow++) FC_DW3_GRADW_PIXEL(T, V, 1)                       \
        FC_DW_UNROLL for (int t = 0; t < 9; t++) {                              \
            memcpy(&sum, dw + t * C + c, sizeof(V));                            \
            sum += acc[t];                                                      \
            memcpy(dw + t * C + c, &sum, sizeof(V));                            \
        }                                                                       \
    }

#define FC_DEFINE_DEPTHWISE_3X3(SUFFIX, T)                                      \
    static inline void fc_depthwise3x3_row_##SUFFIX(                            \
        const T *const rows[3], ptrdiff_t xsw, ptrdiff_t W, ptrdiff_t C,        \
        ptrdiff_t OW, ptrdiff_t SW, ptrdiff_t DW, ptrdiff_t PL,                 \
        ptrdiff_t lo, ptrdiff_t hi, const T *w, const T *bias, T *y)            \
    {                                                                           \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        ptrdiff_t c = 0;                                                        \
        for (; c + VL <= C; c += VL) FC_DW3_STEP(T, fc_dwvec_##SUFFIX)          \
        for (; c < C; c++) FC_DW3_STEP(T, T)                                    \
    }                                                                           \
                                                                                \
    static inline void fc_depthwise3x3_grad_weight_row_##SUFFIX(                \
        const T *const rows[3], ptrdiff_t xsw, ptrdiff_t W, ptrdiff_t C,        \
        ptrdiff_t OW, ptrdiff_t SW, ptrdiff_t DW, ptrdiff_t PL,                 \
        ptrdiff_t lo, ptrdiff_t hi, const T *dy, T *dw)                         \
    {                                                                           \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        ptrdiff_t c = 0;                                                        \
        for (; c + VL <= C; c += VL) FC_DW3_GRADW_STEP(T, fc_dwvec_##SUFFIX)    \
        for (; c < C; c++) FC_DW3_GRADW_STEP(T, T)                              \
    }

FC_DEFINE_DEPTHWISE_TAPS(f32, float)
FC_DEFINE_DEPTHWISE_TAPS(f64, double)
FC_DEFINE_DEPTHWISE_3X3(f32, float)
FC_DEFINE_DEPTHWISE_3X3(f64, double)

#endif
