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

FC_DEFINE_DEPTHWISE_TAPS(f32, float)
FC_DEFINE_DEPTHWISE_TAPS(f64, double)

#endif
