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

#include "micro_kernel.h"       /* FC_STREAM_f32 / _f64 */

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
#define FC_DW3_FOR_TAPS(T, V, CHECK, BODY)                                        \
    FC_DW3_FOR_TAPS_ROWS(T, V, CHECK, 1, BODY)
#define FC_DW3_FOR_TAPS_ROWS(T, V, CHECK, ROWCHECK, BODY)                         \
    /* For each tap t of pixel ow inside the image: src = its input at       \
       channel c; BODY.  ROWCHECK 0: the caller knows all three rows are     \
       inside. */                                                               \
    {                                                                           \
        ptrdiff_t iw0 = ow * SW - PL;                                           \
        FC_DW_UNROLL for (int kh = 0; kh < 3; kh++) {                           \
            if ((ROWCHECK) && rows[kh] == NULL) continue;                       \
            FC_DW_UNROLL for (int kw = 0; kw < 3; kw++) {                       \
                ptrdiff_t iw = iw0 + kw * DW;                                   \
                const int t = kh * 3 + kw;                                      \
                if (CHECK && (iw < 0 || iw >= W)) continue;                     \
                const T *src = rows[kh] + iw * xsw + c;                         \
                BODY                                                            \
            }                                                                   \
        }                                                                       \
    }

/* NV vectors of channels (c .. c + NV*VL) of pixel ow.  FINISH(acc, dst):
 * apply the activation and store (see fc_depthwise3x3_row). */
#define FC_DW3_PIXEL(T, V, NV, CHECK, FINISH)                                   \
    {                                                                           \
        V acc[NV];                                                              \
        FC_DW_UNROLL for (int v = 0; v < NV; v++) acc[v] = bv[v];               \
        FC_DW3_FOR_TAPS(T, V, CHECK,                                               \
            FC_DW_UNROLL for (int v = 0; v < NV; v++) {                         \
                V xv;                                                           \
                memcpy(&xv, src + v * (sizeof(V) / sizeof(T)), sizeof(V));      \
                acc[v] += xv * wv[t][v];                                        \
            })                                                                  \
        FC_DW_UNROLL for (int v = 0; v < NV; v++)                               \
            FINISH(acc[v], y + ow * C + c + v * (sizeof(V) / sizeof(T)));       \
    }

/* The row for channels c .. c + NV*VL: their 9*NV weights in registers. */
#define FC_DW3_STEP(T, V, NV, FINISH)                                           \
    {                                                                           \
        enum { VW = sizeof(V) / sizeof(T) };                                    \
        V wv[9][NV], bv[NV];                                                    \
        FC_DW_UNROLL for (int t = 0; t < 9; t++)                                \
            FC_DW_UNROLL for (int v = 0; v < NV; v++)                           \
                memcpy(&wv[t][v], w + t * C + c + v * VW, sizeof(V));           \
        FC_DW_UNROLL for (int v = 0; v < NV; v++) {                             \
            if (bias) memcpy(&bv[v], bias + c + v * VW, sizeof(V));             \
            else memset(&bv[v], 0, sizeof(V));                                  \
        }                                                                       \
        ptrdiff_t ow = 0;                                                       \
        for (; ow < lo; ow++) FC_DW3_PIXEL(T, V, NV, 1, FINISH)                 \
        for (; ow < hi; ow++) FC_DW3_PIXEL(T, V, NV, 0, FINISH)                 \
        for (; ow < OW; ow++) FC_DW3_PIXEL(T, V, NV, 1, FINISH)                 \
    }

/* The weight gradient of the same layer over a block of output rows: for
 * each channel vector, the 9 taps' sums over the block's pixels stay in
 * registers (acc[t] += x under tap t * dy), added into the thread's
 * partial dw (taps (3, 3), tap t at dw + t*dwt) once per block.  Row r of
 * the block: its input rows at rows[3r .. 3r+2] (NULL outside the image),
 * its output gradients at dy + r*dyr, pixels dyw apart.  A block of rows
 * rather than one: a 14-pixel row paid the setup and the partial sums'
 * update per channel vector, and tested its row pointers at every pixel. */
#define FC_DW3_GRADW_PIXEL(T, V, CHECK, ROWCHECK)                               \
    {                                                                           \
        V dv;                                                                   \
        memcpy(&dv, dyr_ + ow * dyw + c, sizeof(V));                            \
        FC_DW3_FOR_TAPS_ROWS(T, V, CHECK, ROWCHECK, {                           \
            V xv;                                                               \
            memcpy(&xv, src, sizeof(V));                                        \
            acc[t] += xv * dv;                                                  \
        })                                                                      \
    }

#define FC_DW3_GRADW_ROW(T, V, ROWCHECK)                                        \
    {                                                                           \
        ptrdiff_t ow = 0;                                                       \
        for (; ow < lo; ow++) FC_DW3_GRADW_PIXEL(T, V, 1, ROWCHECK)             \
        for (; ow < hi; ow++) FC_DW3_GRADW_PIXEL(T, V, 0, ROWCHECK)             \
        for (; ow < OW; ow++) FC_DW3_GRADW_PIXEL(T, V, 1, ROWCHECK)             \
    }

#define FC_DW3_GRADW_STEP(T, V)                                                 \
    {                                                                           \
        V acc[9], sum;                                                          \
        FC_DW_UNROLL for (int t = 0; t < 9; t++) memset(&acc[t], 0, sizeof(V)); \
        for (ptrdiff_t r = 0; r < nrows; r++) {                                 \
            const T *const *rows = block_rows + 3 * r;                          \
            const T *dyr_ = dy + r * dyr;                                       \
            if (rows[0] != NULL && rows[1] != NULL && rows[2] != NULL)          \
                FC_DW3_GRADW_ROW(T, V, 0)                                       \
            else                                                                \
                FC_DW3_GRADW_ROW(T, V, 1)                                       \
        }                                                                       \
        FC_DW_UNROLL for (int t = 0; t < 9; t++) {                              \
            memcpy(&sum, dw + t * dwt + c, sizeof(V));                          \
            sum += acc[t];                                                      \
            memcpy(dw + t * dwt + c, &sum, sizeof(V));                          \
        }                                                                       \
    }

/* The fused epilogue of a vector of outputs: relu (act 1) or relu6 (act
 * 2) by masks, so that NaN stays NaN as in torch, then a plain store or,
 * for a large output (stream), a non-temporal one (micro_kernel.h). */
#define FC_DW3_FINISH_VEC(SUFFIX, T, IT)                                        \
    static inline void fc_dw3_finish_vec_##SUFFIX(fc_dwvec_##SUFFIX v, int act, \
                                                  int stream, T *dst)           \
    {                                                                           \
        typedef IT ivec __attribute__((vector_size(FC_VBYTES)));                \
        const fc_dwvec_##SUFFIX zero = {0}, six = zero + 6;                     \
        if (act) {                                                              \
            ivec neg = v < zero;                                                \
            v = (fc_dwvec_##SUFFIX)((ivec)v & ~neg);                            \
        }                                                                       \
        if (act == 2) {                                                         \
            ivec big = v > six;                                                 \
            v = (fc_dwvec_##SUFFIX)(((ivec)v & ~big) | ((ivec)six & big));      \
        }                                                                       \
        if (stream)                                                             \
            FC_STREAM_##SUFFIX(dst, v);                                         \
        else                                                                    \
            memcpy(dst, &v, FC_VBYTES);                                         \
    }

#define FC_DW3_FINISH_SCALAR(T)                                                 \
    static inline void fc_dw3_finish_##T(T v, int act, T *dst)                  \
    {                                                                           \
        if (act && v < 0) v = 0;                                                \
        else if (act == 2 && v > 6) v = 6;                                      \
        *dst = v;                                                               \
    }

/* Channel vectors per pass over a row: two, so that one pass reads each
 * input line once for both and stores whole 64-byte lines of output with
 * 32-byte vectors too.  With 32 registers their 18 weights stay in them
 * (AVX-512: 32 channels @112 on 2 threads, 0.094 -> 0.088 ms at batch 1,
 * 0.61 -> 0.55 at batch 8); with AVX2's 16 GCC keeps some on the stack
 * and reloads them (from L1) at each use, which measured no slower than
 * one vector a pass: Zen 3, 2 threads, 576 @14 batch 8 (not streamed),
 * alternating processes, best ms 0.27-0.45 -> 0.24-0.40, median 0.44-0.53
 * -> 0.35-0.44.  One with 16-byte vectors (the baseline build), never
 * measured otherwise. */
#if FC_VBYTES >= 32
#define FC_DW3_VECS 2
#else
#define FC_DW3_VECS 1
#endif

/* Whether the row kernel may stream its output: a pass stores its vectors
 * of channels for each pixel, the next pass their neighbours a row later,
 * so only passes of a whole 64-byte line reach memory as whole lines (and
 * only where C fills whole lines: see depthwise_forward_nogil).  Half lines
 * (AVX2's 32-byte vectors, one a pass) left every write-combining buffer
 * half full: Zen 3, 2 threads, 32 channels @112 batch 8, y reused, 2.95
 * ms streamed against 1.29-1.71 stored (144 @56 b8 3.5-3.6 vs 1.9-2.0).
 * Two a pass, whole lines, alternating processes, best ms stored (one
 * vector a pass) -> streamed: 32 @112 b8 1.24-2.31 -> 0.76-1.80, 144 @56
 * b8 2.2-3.2 -> 1.3-2.9; but 96 @112 b8, whose 38 MB input alone
 * overflows L3, 5.6-8.6 -> 6.5-12.3.  (In a 1x1 -> depthwise -> 1x1
 * sequence at batch 8 the change was lost in the noise of the 1x1s.) */
#define FC_DW3_CAN_STREAM (FC_DW3_VECS * FC_VBYTES >= 64)

/* act: 0 none, 1 relu, 2 relu6.  stream: y is line-aligned, C fills
 * whole lines, and the output large (see
 * depthwise_forward_nogil); the caller fences.  head: 0, or (then
 * nothing is streamed) the channels before the first whose input vectors are
 * vector-aligned, head + VL <= C: then one vector of channels from 0,
 * vectors from head on, and a last vector ending at C, the overlaps
 * computed twice alike.  Zen 4, 2 threads, 576 channels @14 batch 8: input
 * vectors 16 or 48 bytes off a line (each 32-byte half crossing one) made
 * the layer 26-34 % slower than at 0; so shifted, 5 % (the extra vectors
 * and y's stores, now off their lines). */
#define FC_DEFINE_DEPTHWISE_3X3(SUFFIX, T)                                      \
    static inline void fc_depthwise3x3_row_##SUFFIX(                            \
        const T *const rows[3], ptrdiff_t xsw, ptrdiff_t W, ptrdiff_t C,        \
        ptrdiff_t OW, ptrdiff_t SW, ptrdiff_t DW, ptrdiff_t PL,                 \
        ptrdiff_t lo, ptrdiff_t hi, const T *w, const T *bias, T *y,            \
        int act, int stream, ptrdiff_t head)                                    \
    {                                                                           \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        ptrdiff_t c = 0;                                                        \
        if (head > 0) {                                                         \
            stream = 0;     /* its vectors are off y's lines */                 \
            FC_DW3_STEP(T, fc_dwvec_##SUFFIX, 1, FC_DW3_VEC_FINISH_##SUFFIX)    \
            c = head;                                                           \
        }                                                                       \
        for (; c + FC_DW3_VECS * VL <= C; c += FC_DW3_VECS * VL)                \
            FC_DW3_STEP(T, fc_dwvec_##SUFFIX, FC_DW3_VECS,                      \
                        FC_DW3_VEC_FINISH_##SUFFIX)                             \
        for (; c + VL <= C; c += VL)                                            \
            FC_DW3_STEP(T, fc_dwvec_##SUFFIX, 1, FC_DW3_VEC_FINISH_##SUFFIX)    \
        if (head > 0 && c < C) {                                                \
            c = C - VL;                                                         \
            FC_DW3_STEP(T, fc_dwvec_##SUFFIX, 1, FC_DW3_VEC_FINISH_##SUFFIX)    \
            c = C;                                                              \
        }                                                                       \
        for (; c < C; c++) FC_DW3_STEP(T, T, 1, FC_DW3_SCALAR_FINISH_##SUFFIX)  \
    }                                                                           \
                                                                                \
    static inline void fc_depthwise3x3_grad_weight_rows_##SUFFIX(               \
        const T *const *block_rows, ptrdiff_t nrows, ptrdiff_t xsw,             \
        ptrdiff_t W, ptrdiff_t C, ptrdiff_t OW, ptrdiff_t SW, ptrdiff_t DW,     \
        ptrdiff_t PL, ptrdiff_t lo, ptrdiff_t hi, const T *dy, ptrdiff_t dyw,   \
        ptrdiff_t dyr, T *dw, ptrdiff_t dwt)                                    \
    {                                                                           \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        ptrdiff_t c = 0;                                                        \
        for (; c + VL <= C; c += VL) FC_DW3_GRADW_STEP(T, fc_dwvec_##SUFFIX)    \
        for (; c < C; c++) FC_DW3_GRADW_STEP(T, T)                              \
    }

FC_DEFINE_DEPTHWISE_TAPS(f32, float)
FC_DEFINE_DEPTHWISE_TAPS(f64, double)
FC_DW3_FINISH_VEC(f32, float, int)
FC_DW3_FINISH_VEC(f64, double, long long)
FC_DW3_FINISH_SCALAR(float)
FC_DW3_FINISH_SCALAR(double)
#define FC_DW3_VEC_FINISH_f32(acc, dst) fc_dw3_finish_vec_f32(acc, act, stream, dst)
#define FC_DW3_VEC_FINISH_f64(acc, dst) fc_dw3_finish_vec_f64(acc, act, stream, dst)
#define FC_DW3_SCALAR_FINISH_f32(acc, dst) fc_dw3_finish_float(acc, act, dst)
#define FC_DW3_SCALAR_FINISH_f64(acc, dst) fc_dw3_finish_double(acc, act, dst)
FC_DEFINE_DEPTHWISE_3X3(f32, float)
FC_DEFINE_DEPTHWISE_3X3(f64, double)

#endif
