/* Weight gradients of layers with few output channels, one source for every
 * ISA build (FC_VBYTES is defined by the including module, as for
 * micro_kernel.h).
 *
 * acc[oc][j] (+)= sum_m dy[m][oc] * p[m][j]: the weight gradient's product
 * dy^T @ patches where dy has few columns (an RGB output layer's 3).  The
 * GEMM frame's tiles (12 x 32 float on AVX-512) put the output channels
 * along the 32 vector columns (patches on the left) or along the 12
 * broadcast rows (dy on the left, every patch row packed); either way most
 * of the tile idled: 3x3 64->3 @224 b1 took 11 ms, torch 4.4.  Here up to
 * four output channels are the broadcast rows, and NV vectors of patch
 * columns the tile's width: each patch row is read once per four output
 * channels, where it lies (windows of the image's rows: see
 * grad_weight_few_outputs in conv_frame.pxi).
 */
#ifndef FASTCONV_FEW_OUTPUTS_KERNEL_H
#define FASTCONV_FEW_OUTPUTS_KERNEL_H

#include <stddef.h>
#include <string.h>

#if defined(__clang__)
#define FC_FO_UNROLL _Pragma("clang loop unroll(full)")
#else
#define FC_FO_UNROLL _Pragma("GCC unroll 16")
#endif

/* The most output channels one tile holds, and the tile's vectors of
 * patch columns for 1..4 of them: OCT x NV accumulators, within 32
 * registers (AVX-512) or 16 (the others) beside a loaded vector and a
 * broadcast. */
#define FC_FEW_OC_TILE 4
#if FC_VBYTES >= 64
#define FC_FEW_OC_NV(OCT) ((OCT) == 4 ? 6 : 8)
#else
#define FC_FEW_OC_NV(OCT) ((OCT) == 1 ? 8 : (OCT) == 2 ? 6 : (OCT) == 3 ? 4 : 3)
#endif

/* The OCT x (NV vectors) tile at acc (rows ldacc apart): the sum over rows
 * m of dy[m*rsdy + i] * p[m*ldp + j], added to acc, or stored over it when
 * overwrite. */
#define FC_DEFINE_FEW_OC_TILE(SUFFIX, T, OCT, NV, NAME)                         \
    static inline void fc_few_oc_tile_##SUFFIX##_##OCT##_##NAME(                \
        ptrdiff_t rows, const T *restrict dy, ptrdiff_t rsdy,                   \
        const T *restrict p, ptrdiff_t ldp, T *restrict acc, ptrdiff_t ldacc,   \
        int overwrite)                                                          \
    {                                                                           \
        typedef fc_fovec_##SUFFIX VEC;                                          \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        VEC c[OCT][NV];                                                         \
        FC_FO_UNROLL for (int i = 0; i < (OCT); i++)                            \
            FC_FO_UNROLL for (int j = 0; j < (NV); j++)                         \
                c[i][j] = (VEC){0};                                             \
        for (ptrdiff_t m = 0; m < rows; m++) {                                  \
            T d[OCT];                                                           \
            FC_FO_UNROLL for (int i = 0; i < (OCT); i++)                        \
                d[i] = dy[i];                                                   \
            FC_FO_UNROLL for (int j = 0; j < (NV); j++) {                       \
                VEC pv;                                                         \
                memcpy(&pv, p + j * VL, FC_VBYTES);                             \
                FC_FO_UNROLL for (int i = 0; i < (OCT); i++)                    \
                    c[i][j] += d[i] * pv;                                       \
            }                                                                   \
            dy += rsdy;                                                         \
            p += ldp;                                                           \
        }                                                                       \
        FC_FO_UNROLL for (int i = 0; i < (OCT); i++)                            \
            FC_FO_UNROLL for (int j = 0; j < (NV); j++) {                       \
                T *o = acc + i * ldacc + j * VL;                                \
                VEC v = c[i][j], w;                                             \
                if (!overwrite) {                                               \
                    memcpy(&w, o, FC_VBYTES);                                   \
                    v = v + w;                                                  \
                }                                                               \
                memcpy(o, &v, FC_VBYTES);                                       \
            }                                                                   \
    }

/* OCT output channels over ncols patch columns: tiles of NV vectors, then
 * of NV / 2 (a 64-channel kernel tap is 4 float vectors on AVX-512), then
 * single vectors; the last ncols % VL columns as the last lanes of the
 * vector that ends at ncols, or, narrower than a vector, one at a time. */
#define FC_FEW_OC_COLUMNS(SUFFIX, T, OCT)                                       \
    {                                                                           \
        enum { NV = FC_FEW_OC_NV(OCT) };                                        \
        ptrdiff_t j = 0;                                                        \
        for (; j + NV * VL <= ncols; j += NV * VL)                              \
            fc_few_oc_tile_##SUFFIX##_##OCT##_wide(rows, dy, rsdy, p + j, ldp,  \
                                                   acc + j, ldacc, overwrite); \
        for (; j + NV / 2 * VL <= ncols; j += NV / 2 * VL)                      \
            fc_few_oc_tile_##SUFFIX##_##OCT##_half(rows, dy, rsdy, p + j, ldp,  \
                                                   acc + j, ldacc, overwrite); \
        for (; j + VL <= ncols; j += VL)                                        \
            fc_few_oc_tile_##SUFFIX##_##OCT##_one(rows, dy, rsdy, p + j, ldp,   \
                                                  acc + j, ldacc, overwrite);   \
        if (j < ncols && ncols >= VL) {                                         \
            /* The last vector of columns, ncols - VL.., into a stack tile, \
               of which the lanes from j on go to acc. */                   \
            T last[(OCT) * VL];                                                 \
            fc_few_oc_tile_##SUFFIX##_##OCT##_one(rows, dy, rsdy,               \
                                                  p + ncols - VL, ldp, last,    \
                                                  VL, 1);                       \
            FC_FO_UNROLL for (int i = 0; i < (OCT); i++)                        \
                for (ptrdiff_t l = j; l < ncols; l++) {                         \
                    T s = last[i * VL + l - (ncols - VL)];                      \
                    acc[i * ldacc + l] = overwrite ? s : acc[i * ldacc + l] + s; \
                }                                                               \
            j = ncols;                                                          \
        }                                                                       \
        for (; j < ncols; j++)                                                  \
            FC_FO_UNROLL for (int i = 0; i < (OCT); i++) {                      \
                T s = 0;                                                        \
                for (ptrdiff_t m = 0; m < rows; m++)                            \
                    s += dy[m * rsdy + i] * p[m * ldp + j];                     \
                acc[i * ldacc + j] = overwrite ? s : acc[i * ldacc + j] + s;    \
            }                                                                   \
    }

#define FC_DEFINE_FEW_OUTPUTS(SUFFIX, T)                                         \
    typedef T fc_fovec_##SUFFIX __attribute__((vector_size(FC_VBYTES)));        \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 1, 1, one)                                 \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 2, 1, one)                                 \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 3, 1, one)                                 \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 4, 1, one)                                 \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 1, FC_FEW_OC_NV(1), wide)                  \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 2, FC_FEW_OC_NV(2), wide)                  \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 3, FC_FEW_OC_NV(3), wide)                  \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 4, FC_FEW_OC_NV(4), wide)                  \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 1, FC_FEW_OC_NV(1) / 2, half)              \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 2, FC_FEW_OC_NV(2) / 2, half)              \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 3, FC_FEW_OC_NV(3) / 2, half)              \
    FC_DEFINE_FEW_OC_TILE(SUFFIX, T, 4, FC_FEW_OC_NV(4) / 2, half)              \
    /* acc[oc*ldacc + j] (+)= sum_m dy[m*rsdy + oc] * p[m*ldp + j] for      \
       oc < OC, j < ncols: output channels four at a time. */               \
    static void fc_few_outputs_grad_weight_##SUFFIX(                            \
        ptrdiff_t rows, ptrdiff_t OC, ptrdiff_t ncols, const T *dy,             \
        ptrdiff_t rsdy, const T *p, ptrdiff_t ldp, T *acc, ptrdiff_t ldacc,     \
        int overwrite)                                                          \
    {                                                                           \
        enum { VL = FC_VBYTES / sizeof(T) };                                    \
        for (ptrdiff_t oc = 0; oc < OC; oc += FC_FEW_OC_TILE) {                 \
            ptrdiff_t n = OC - oc < FC_FEW_OC_TILE ? OC - oc : FC_FEW_OC_TILE;  \
            switch (n) {                                                        \
            case 1: FC_FEW_OC_COLUMNS(SUFFIX, T, 1) break;                      \
            case 2: FC_FEW_OC_COLUMNS(SUFFIX, T, 2) break;                      \
            case 3: FC_FEW_OC_COLUMNS(SUFFIX, T, 3) break;                      \
            default: FC_FEW_OC_COLUMNS(SUFFIX, T, 4) break;                     \
            }                                                                   \
            dy += FC_FEW_OC_TILE;                                               \
            acc += FC_FEW_OC_TILE * ldacc;                                      \
        }                                                                       \
    }

FC_DEFINE_FEW_OUTPUTS(f32, float)
FC_DEFINE_FEW_OUTPUTS(f64, double)

#endif
