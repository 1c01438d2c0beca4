/* The GEMM micro-kernel, one source for every ISA build.
 *
 * acc[MR*NR] = A_panel (kc x MR, packed: MR values per k) @ B_panel (kc x NR,
 * packed: NR values per k), accumulated in MR x (NR/VL) vector registers.
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
#include <string.h>

#if !defined(__GNUC__)
#error "fastconv's micro-kernel needs GCC or Clang vector extensions"
#endif

#define FC_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define FC_UNROLL FC_PRAGMA(clang loop unroll(full))
#else
#define FC_UNROLL FC_PRAGMA(GCC unroll 64)
#endif

#define FC_DEFINE_MICRO_KERNEL(NAME, T, MR, NR)                                  \
    typedef T NAME##_vec __attribute__((vector_size(FC_VBYTES)));               \
    static inline void NAME(ptrdiff_t kc, const T *restrict a,                  \
                            const T *restrict b, T *restrict acc)              \
    {                                                                           \
        enum { VL = FC_VBYTES / sizeof(T), NV = (NR) / VL };                    \
        NAME##_vec c[MR][NV];                                                   \
        FC_UNROLL for (int i = 0; i < (MR); i++)                                \
            FC_UNROLL for (int j = 0; j < NV; j++)                              \
                c[i][j] = (NAME##_vec){0};                                      \
        for (ptrdiff_t p = 0; p < kc; p++) {                                    \
            NAME##_vec bv[NV];                                                  \
            /* memcpy: an unaligned-safe vector load the compiler folds. */     \
            FC_UNROLL for (int j = 0; j < NV; j++)                              \
                memcpy(&bv[j], b + j * VL, FC_VBYTES);                          \
            FC_UNROLL for (int i = 0; i < (MR); i++) {                          \
                const T ai = a[i];                                              \
                FC_UNROLL for (int j = 0; j < NV; j++)                          \
                    c[i][j] += ai * bv[j];                                      \
            }                                                                   \
            a += (MR);                                                          \
            b += (NR);                                                          \
        }                                                                       \
        FC_UNROLL for (int i = 0; i < (MR); i++)                                \
            FC_UNROLL for (int j = 0; j < NV; j++)                              \
                memcpy(acc + i * (NR) + j * VL, &c[i][j], FC_VBYTES);           \
    }

FC_DEFINE_MICRO_KERNEL(fc_micro_kernel_f32, float, FC_S_MR, FC_S_NR)
FC_DEFINE_MICRO_KERNEL(fc_micro_kernel_f64, double, FC_D_MR, FC_D_NR)

#endif
