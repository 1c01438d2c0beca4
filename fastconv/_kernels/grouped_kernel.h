/* The narrow-group direct kernels, one source for every ISA build
 * (FC_VBYTES is defined by the including module, as for micro_kernel.h).
 *
 * A grouped convolution with KG input and KG output channels per group
 * (ResNeXt: 32 groups of 4 or 8) is, as GEMMs, one product per group only
 * KG wide: the micro-kernel's 32 columns are 1/8 used and the packing
 * dominates (4-8x slower than torch).  Here output channels are the vector
 * axis, as in the depthwise kernel.  With KG below the vector length VL, a
 * vector of VL output channels spans VL/KG whole groups, and those groups'
 * inputs are the same VL input channels.  Lane l = g*KG + j needs input
 * channel g*KG + i for each i < KG: one in-register shuffle of the loaded
 * input vector, so each FMA costs a shuffle and no load: the input pixel's
 * vector is loaded once per tap and the tap's weights once per block of
 * pixels.  With KG at least VL (each vector within one group) input i is
 * broadcast from memory instead.
 *
 * Weights come as (KH, KW, KG, C): w[kh][kw][i][g*KG + j] is output channel
 * g*KG + j's weight for input g*KG + i under tap (kh, kw).
 */
#ifndef FASTCONV_GROUPED_KERNEL_H
#define FASTCONV_GROUPED_KERNEL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__clang__)
#define FC_G_UNROLL _Pragma("clang loop unroll(full)")
#else
#define FC_G_UNROLL _Pragma("GCC unroll 16")
#endif

#define FC_G_INLINE static inline __attribute__((always_inline))

/* Output pixels per register block: accumulators and input vectors for 8
 * pixels use 16 of AVX-512's 32 registers; 4 fit the 16 of AVX2/SSE/NEON. */
#define FC_G_PIXELS (FC_VBYTES == 64 ? 8 : 4)

/* The widest group the kernels are built for (fc_grouped_width_supported). */
#define FC_G_MAX_WIDTH 16

#if defined(__GNUC__) && !defined(__clang__)
#define FC_G_SHUFFLE(v, m) __builtin_shuffle(v, m)
#else
#define FC_G_SHUFFLE(v, m) fc_g_shuffle_generic(v, m)
#endif

#define FC_DEFINE_GROUPED(SUFFIX, T, IT)                                       \
    typedef T fc_gvec_##SUFFIX __attribute__((vector_size(FC_VBYTES)));        \
    typedef IT fc_gidx_##SUFFIX __attribute__((vector_size(FC_VBYTES)));       \
    enum { FC_G_VL_##SUFFIX = FC_VBYTES / sizeof(T) };                         \
                                                                               \
    FC_G_INLINE fc_gvec_##SUFFIX fc_g_load_##SUFFIX(const T *p, ptrdiff_t nc,  \
                                                    const int full)            \
    {                                                                          \
        fc_gvec_##SUFFIX v = {0};                                              \
        if (full) memcpy(&v, p, sizeof v);                                     \
        else memcpy(&v, p, nc * sizeof(T));                                    \
        return v;                                                              \
    }                                                                          \
                                                                               \
    /* Lane l of the result is lane (l rounded down to its group) + i of v:    \
       input channel i of each lane's group. */                                \
    FC_G_INLINE fc_gvec_##SUFFIX fc_g_group_lane_##SUFFIX(                     \
        fc_gvec_##SUFFIX v, const int KG, const int i)                         \
    {                                                                          \
        /* Groups inside 128-bit lanes: an immediate in-lane permute           \
           (GCC 12 emits a lane-crossing vpermps for the mask below, which     \
           needs an index register per i and is slower on Zen 4). */           \
        FC_G_INLANE_##SUFFIX(v, KG, i);                                        \
        static const IT lanes[16] = {0, 1, 2, 3, 4, 5, 6, 7,                   \
                                     8, 9, 10, 11, 12, 13, 14, 15};            \
        fc_gidx_##SUFFIX m;                                                    \
        memcpy(&m, lanes, sizeof m);                                           \
        m = (m & (IT)~(KG - 1)) + (IT)i;                                       \
        return FC_G_SHUFFLE_##SUFFIX(v, m);                                    \
    }                                                                          \
                                                                               \
    FC_G_INLINE fc_gvec_##SUFFIX fc_g_activate_##SUFFIX(fc_gvec_##SUFFIX v,    \
                                                        int act)               \
    {                                                                          \
        /* act 1: relu, 2: relu6 (the kernels' ACT_* codes); NaN stays NaN,  \
           as in torch (only v < 0 and v > 6 are replaced). */                 \
        if (act) {                                                             \
            fc_gvec_##SUFFIX zero = {0}, six = zero + 6;                       \
            v = (fc_gvec_##SUFFIX)(~(fc_gidx_##SUFFIX)(v < zero)               \
                                   & (fc_gidx_##SUFFIX)v);                     \
            if (act == 2) {                                                    \
                fc_gidx_##SUFFIX gt = (fc_gidx_##SUFFIX)(v > six);             \
                v = (fc_gvec_##SUFFIX)((gt & (fc_gidx_##SUFFIX)six)            \
                                       | (~gt & (fc_gidx_##SUFFIX)v));         \
            }                                                                  \
        }                                                                      \
        return v;                                                              \
    }                                                                          \
                                                                               \
    /* NP <= FC_G_PIXELS output pixels ow.. of one row, channels c..c+VL       \
       (nc of them when not full).  rows[kh]: input row oh*SH - PT + kh*DH     \
       at channel 0, or NULL outside the image; CHECK: some tap column may     \
       be outside.  The pixel loops run to the constant FC_G_PIXELS, guarded   \
       by p < NP, so the accumulators stay in registers whatever NP is (one    \
       pixel at a time would be a chain of dependent FMAs). */                 \
    FC_G_INLINE void fc_grouped_pixels_##SUFFIX(                               \
        const T *const *rows, ptrdiff_t KH, ptrdiff_t KW, ptrdiff_t xsw,       \
        ptrdiff_t W, ptrdiff_t C, const int KG, ptrdiff_t NP, const int CHECK, \
        const int FULL, ptrdiff_t nc, ptrdiff_t c, ptrdiff_t ow, ptrdiff_t SW, \
        ptrdiff_t DW, ptrdiff_t PL, const T *w, const T *bias, int act, T *y)  \
    {                                                                          \
        typedef fc_gvec_##SUFFIX vec;                                          \
        vec acc[FC_G_PIXELS], xv[FC_G_PIXELS] = {{0}}, bv = {0};               \
        if (bias) bv = fc_g_load_##SUFFIX(bias + c, nc, FULL);                 \
        FC_G_UNROLL for (int p = 0; p < FC_G_PIXELS; p++) acc[p] = bv;         \
        for (ptrdiff_t kh = 0; kh < KH; kh++) {                                \
            if (rows[kh] == NULL) continue;                                    \
            /* (A vector within one group reads from the group's start.) */    \
            const T *row = rows[kh] + (KG >= FC_G_VL_##SUFFIX ? c - c % KG : c); \
            for (ptrdiff_t kw = 0; kw < KW; kw++) {                            \
                ptrdiff_t iw0 = ow * SW - PL + kw * DW;                        \
                const T *wt = w + (kh * KW + kw) * KG * C + c;                 \
                if (KG >= FC_G_VL_##SUFFIX) {                                  \
                    /* Each vector within one group: input i is a broadcast    \
                       from memory (a load, no shuffle; KG masks and KG pixel  \
                       vectors would not fit the registers either). */         \
                    const T *xp[FC_G_PIXELS] = {0};                            \
                    FC_G_UNROLL for (int p = 0; p < FC_G_PIXELS; p++) if (p < NP) { \
                        ptrdiff_t iw = iw0 + p * SW;                           \
                        xp[p] = CHECK && (iw < 0 || iw >= W) ? NULL : row + iw * xsw; \
                    }                                                          \
                    FC_G_UNROLL for (int i = 0; i < KG; i++) {                 \
                        vec wv = fc_g_load_##SUFFIX(wt + i * C, nc, FULL);     \
                        FC_G_UNROLL for (int p = 0; p < FC_G_PIXELS; p++) if (p < NP) \
                            if (!CHECK || xp[p]) acc[p] += wv * xp[p][i];      \
                    }                                                          \
                    continue;                                                  \
                }                                                              \
                FC_G_UNROLL for (int p = 0; p < FC_G_PIXELS; p++) if (p < NP) { \
                    ptrdiff_t iw = iw0 + p * SW;                               \
                    if (CHECK && (iw < 0 || iw >= W)) xv[p] = (vec){0};        \
                    else xv[p] = fc_g_load_##SUFFIX(row + iw * xsw, nc, FULL); \
                }                                                              \
                FC_G_UNROLL for (int i = 0; i < KG; i++) {                     \
                    vec wv = fc_g_load_##SUFFIX(wt + i * C, nc, FULL);         \
                    FC_G_UNROLL for (int p = 0; p < FC_G_PIXELS; p++) if (p < NP) \
                        acc[p] += fc_g_group_lane_##SUFFIX(xv[p], KG, i) * wv; \
                }                                                              \
            }                                                                  \
        }                                                                      \
        FC_G_UNROLL for (int p = 0; p < FC_G_PIXELS; p++) if (p < NP) {        \
            vec v = fc_g_activate_##SUFFIX(acc[p], act);                       \
            memcpy(y + (ow + p) * C + c, &v, (FULL ? FC_G_VL_##SUFFIX : nc) * sizeof(T)); \
        }                                                                      \
    }                                                                          \
                                                                               \
    FC_G_INLINE void fc_grouped_row_width_##SUFFIX(                            \
        const T *const *rows, ptrdiff_t KH, ptrdiff_t KW, ptrdiff_t xsw,       \
        ptrdiff_t W, ptrdiff_t C, const int KG, ptrdiff_t OW, ptrdiff_t SW,    \
        ptrdiff_t DW, ptrdiff_t PL, ptrdiff_t lo, ptrdiff_t hi, const T *w,    \
        const T *bias, int act, T *y)                                          \
    {                                                                          \
        enum { VL = FC_G_VL_##SUFFIX, P = FC_G_PIXELS };                       \
        ptrdiff_t c = 0;                                                       \
        for (; c + VL <= C; c += VL)                                           \
            for (ptrdiff_t ow = 0; ow < OW; ow += P) {                         \
                if (ow >= lo && ow + P <= hi)                                  \
                    fc_grouped_pixels_##SUFFIX(rows, KH, KW, xsw, W, C, KG, P, 0, 1, VL, \
                                               c, ow, SW, DW, PL, w, bias, act, y); \
                else                                                           \
                    fc_grouped_pixels_##SUFFIX(rows, KH, KW, xsw, W, C, KG,    \
                                               OW - ow < P ? OW - ow : P, 1, 1, VL, \
                                               c, ow, SW, DW, PL, w, bias, act, y); \
            }                                                                  \
        if (c < C) /* the last groups, fewer than a vector's worth */          \
            for (ptrdiff_t ow = 0; ow < OW; ow += P)                           \
                fc_grouped_pixels_##SUFFIX(rows, KH, KW, xsw, W, C, KG,        \
                                           OW - ow < P ? OW - ow : P, 1, 0, C - c, \
                                           c, ow, SW, DW, PL, w, bias, act, y); \
    }                                                                          \
                                                                               \
    /* One output row of the forward: y (OW, C) = conv of the rows, + bias,    \
       activation.  Pixels ow in [lo, hi) have every tap column inside the     \
       image.  Returns -1 for a group width it is not built for. */            \
    static int fc_grouped_row_##SUFFIX(                                        \
        const T *const *rows, ptrdiff_t KH, ptrdiff_t KW, ptrdiff_t xsw,       \
        ptrdiff_t W, ptrdiff_t C, ptrdiff_t KG, ptrdiff_t OW, ptrdiff_t SW,    \
        ptrdiff_t DW, ptrdiff_t PL, ptrdiff_t lo, ptrdiff_t hi, const T *w,    \
        const T *bias, int act, T *y)                                          \
    {                                                                          \
        switch (KG) {                                                          \
        FC_G_WIDTH_CASES(fc_grouped_row_width_##SUFFIX(rows, KH, KW, xsw, W, C, \
            FC_G_K, OW, SW, DW, PL, lo, hi, w, bias, act, y), SUFFIX)          \
        default: return -1;                                                    \
        }                                                                      \
        return 0;                                                              \
    }                                                                          \
                                                                               \
    /* The weight gradient of one output row: dw (KH, KW, KG, C) += each       \
       tap's input (shuffled to its lanes' input channel i) times the row's    \
       output gradients dy (OW, C); per channel vector and tap, KG sums stay   \
       in registers over the row's pixels. */                                  \
    FC_G_INLINE void fc_grouped_grad_weight_width_##SUFFIX(                    \
        const T *const *rows, ptrdiff_t KH, ptrdiff_t KW, ptrdiff_t xsw,       \
        ptrdiff_t W, ptrdiff_t C, const int KG, ptrdiff_t OW, ptrdiff_t SW,    \
        ptrdiff_t DW, ptrdiff_t PL, const T *dy, T *dw)                        \
    {                                                                          \
        typedef fc_gvec_##SUFFIX vec;                                          \
        enum { VL = FC_G_VL_##SUFFIX };                                        \
        for (ptrdiff_t c = 0; c < C; c += VL) {                                \
            const ptrdiff_t nc = C - c < VL ? C - c : VL;                      \
            for (ptrdiff_t kh = 0; kh < KH; kh++) {                            \
                if (rows[kh] == NULL) continue;                                \
                const T *row = rows[kh] + (KG >= VL ? c - c % KG : c);         \
                for (ptrdiff_t kw = 0; kw < KW; kw++) {                        \
                    /* The pixels whose column iw = ow*SW + off is inside. */  \
                    ptrdiff_t off = kw * DW - PL;                              \
                    ptrdiff_t a = off >= 0 ? 0 : (-off + SW - 1) / SW;         \
                    ptrdiff_t b = off >= W ? 0 : (W - 1 - off) / SW + 1;       \
                    if (b > OW) b = OW;                                        \
                    vec acc[FC_G_MAX_WIDTH];                                   \
                    FC_G_UNROLL for (int i = 0; i < KG; i++) acc[i] = (vec){0}; \
                    if (nc == VL) {                                            \
                        ptrdiff_t ow = a;                                      \
                        if (KG < VL && KG <= 8) {                              \
                            /* Two pixels a step into two sets of sums: KG     \
                               chains of dependent FMAs alone would leave the  \
                               FMA units waiting on their latency. */          \
                            vec acc2[8];                                       \
                            FC_G_UNROLL for (int i = 0; i < KG; i++) acc2[i] = (vec){0}; \
                            for (; ow + 1 < b; ow += 2) {                      \
                                vec x0 = fc_g_load_##SUFFIX(row + (ow * SW + off) * xsw, VL, 1); \
                                vec x1 = fc_g_load_##SUFFIX(row + ((ow + 1) * SW + off) * xsw, VL, 1); \
                                vec d0 = fc_g_load_##SUFFIX(dy + ow * C + c, VL, 1); \
                                vec d1 = fc_g_load_##SUFFIX(dy + (ow + 1) * C + c, VL, 1); \
                                FC_G_UNROLL for (int i = 0; i < KG; i++) {     \
                                    acc[i] += fc_g_group_lane_##SUFFIX(x0, KG, i) * d0; \
                                    acc2[i] += fc_g_group_lane_##SUFFIX(x1, KG, i) * d1; \
                                }                                              \
                            }                                                  \
                            FC_G_UNROLL for (int i = 0; i < KG; i++) acc[i] += acc2[i]; \
                        }                                                      \
                        for (; ow < b; ow++) {                                 \
                            const T *xp = row + (ow * SW + off) * xsw;         \
                            vec dv = fc_g_load_##SUFFIX(dy + ow * C + c, VL, 1); \
                            if (KG >= VL) { /* broadcasts, as in the forward */ \
                                FC_G_UNROLL for (int i = 0; i < KG; i++)       \
                                    acc[i] += dv * xp[i];                      \
                                continue;                                      \
                            }                                                  \
                            vec xv = fc_g_load_##SUFFIX(xp, VL, 1);            \
                            FC_G_UNROLL for (int i = 0; i < KG; i++)           \
                                acc[i] += fc_g_group_lane_##SUFFIX(xv, KG, i) * dv; \
                        }                                                      \
                    } else {                                                   \
                        for (ptrdiff_t ow = a; ow < b; ow++) {                 \
                            vec xv = fc_g_load_##SUFFIX(row + (ow * SW + off) * xsw, nc, 0); \
                            vec dv = fc_g_load_##SUFFIX(dy + ow * C + c, nc, 0); \
                            FC_G_UNROLL for (int i = 0; i < KG; i++)           \
                                acc[i] += fc_g_group_lane_##SUFFIX(xv, KG, i) * dv; \
                        }                                                      \
                    }                                                          \
                    T *dt = dw + (kh * KW + kw) * KG * C + c;                  \
                    FC_G_UNROLL for (int i = 0; i < KG; i++) {                 \
                        vec s = fc_g_load_##SUFFIX(dt + i * C, nc, nc == VL);  \
                        s += acc[i];                                           \
                        memcpy(dt + i * C, &s, nc * sizeof(T));                \
                    }                                                          \
                }                                                              \
            }                                                                  \
        }                                                                      \
    }                                                                          \
                                                                               \
    static int fc_grouped_grad_weight_row_##SUFFIX(                            \
        const T *const *rows, ptrdiff_t KH, ptrdiff_t KW, ptrdiff_t xsw,       \
        ptrdiff_t W, ptrdiff_t C, ptrdiff_t KG, ptrdiff_t OW, ptrdiff_t SW,    \
        ptrdiff_t DW, ptrdiff_t PL, const T *dy, T *dw)                        \
    {                                                                          \
        switch (KG) {                                                          \
        FC_G_WIDTH_CASES(fc_grouped_grad_weight_width_##SUFFIX(rows, KH, KW,   \
            xsw, W, C, FC_G_K, OW, SW, DW, PL, dy, dw), SUFFIX)                \
        default: return -1;                                                    \
        }                                                                      \
        return 0;                                                              \
    }

/* `case K: CALL; break;` for each group width (FC_G_K is K inside CALL). */
#define FC_G_CASE(K, CALL, SUFFIX)                                             \
    case K: {                                                                  \
        enum { FC_G_K = K };                                                   \
        CALL;                                                                  \
        break;                                                                 \
    }
#define FC_G_WIDTH_CASES(CALL, SUFFIX)                                         \
    FC_G_CASE(2, CALL, SUFFIX) FC_G_CASE(4, CALL, SUFFIX)                      \
    FC_G_CASE(8, CALL, SUFFIX) FC_G_CASE(16, CALL, SUFFIX)

/* vpermilps immediate: position q of each 128-bit lane takes element
 * (q rounded down to a multiple of K) + I of that lane. */
#define FC_G_IMM_PS(K, I)                                                      \
    (((0 & ~((K) - 1)) + (I)) | (((1 & ~((K) - 1)) + (I)) << 2)                \
     | (((2 & ~((K) - 1)) + (I)) << 4) | (((3 & ~((K) - 1)) + (I)) << 6))

#if FC_VBYTES == 64 && defined(__AVX512F__)
#include <immintrin.h>
#define FC_G_PERMUTE_PS(v, imm) _mm512_permute_ps((__m512)(v), imm)
#define FC_G_PERMUTE_PD(v, imm) _mm512_permute_pd((__m512d)(v), imm)
/* Groups of 256 bits (8 floats, 4 doubles): 128-bit lane J of each 256-bit
 * half copied to both of that half's lanes (vshuff32x4, an immediate),
 * then an in-lane permute picks the element: two immediate shuffles per
 * FMA instead of one lane-crossing vpermps with an index register. */
#define FC_G_IMM_HALF_LANE(J) ((J) | ((J) << 2) | ((2 + (J)) << 4) | ((2 + (J)) << 6))
#define FC_G_HALF_PS(v, I)                                                     \
    _mm512_permute_ps(_mm512_shuffle_f32x4((__m512)(v), (__m512)(v),           \
                                           FC_G_IMM_HALF_LANE((I) / 4)),       \
                      FC_G_IMM_PS(4, (I) % 4))
#define FC_G_HALF_PD(v, I)                                                     \
    _mm512_permute_pd(_mm512_shuffle_f64x2((__m512d)(v), (__m512d)(v),         \
                                           FC_G_IMM_HALF_LANE((I) / 2)),       \
                      (I) % 2 ? 0xFF : 0x00)
#define FC_G_HALF_CASES_f32(v)                                                 \
    case 32: return (__typeof__(v))FC_G_HALF_PS(v, 0);                         \
    case 33: return (__typeof__(v))FC_G_HALF_PS(v, 1);                         \
    case 34: return (__typeof__(v))FC_G_HALF_PS(v, 2);                         \
    case 35: return (__typeof__(v))FC_G_HALF_PS(v, 3);                         \
    case 36: return (__typeof__(v))FC_G_HALF_PS(v, 4);                         \
    case 37: return (__typeof__(v))FC_G_HALF_PS(v, 5);                         \
    case 38: return (__typeof__(v))FC_G_HALF_PS(v, 6);                         \
    case 39: return (__typeof__(v))FC_G_HALF_PS(v, 7);
#define FC_G_HALF_CASES_f64(v)                                                 \
    case 16: return (__typeof__(v))FC_G_HALF_PD(v, 0);                         \
    case 17: return (__typeof__(v))FC_G_HALF_PD(v, 1);                         \
    case 18: return (__typeof__(v))FC_G_HALF_PD(v, 2);                         \
    case 19: return (__typeof__(v))FC_G_HALF_PD(v, 3);
#elif FC_VBYTES == 32 && defined(__AVX__)
#include <immintrin.h>
#define FC_G_PERMUTE_PS(v, imm) _mm256_permute_ps((__m256)(v), imm)
#define FC_G_PERMUTE_PD(v, imm) _mm256_permute_pd((__m256d)(v), (imm) & 15)
#elif FC_VBYTES == 16 && defined(__SSE2__)
#include <emmintrin.h>
#define FC_G_PERMUTE_PS(v, imm) _mm_shuffle_ps((__m128)(v), (__m128)(v), imm)
#define FC_G_PERMUTE_PD(v, imm) _mm_shuffle_pd((__m128d)(v), (__m128d)(v), (imm) & 3)
#endif

#ifndef FC_G_HALF_CASES_f32
#define FC_G_HALF_CASES_f32(v)
#define FC_G_HALF_CASES_f64(v)
#endif

#ifdef FC_G_PERMUTE_PS
#define FC_G_INLANE_f32(v, KG, i)                                              \
    switch ((KG) * 4 + (i)) {                                                  \
    case 8: return (__typeof__(v))FC_G_PERMUTE_PS(v, FC_G_IMM_PS(2, 0));       \
    case 9: return (__typeof__(v))FC_G_PERMUTE_PS(v, FC_G_IMM_PS(2, 1));       \
    case 16: return (__typeof__(v))FC_G_PERMUTE_PS(v, FC_G_IMM_PS(4, 0));      \
    case 17: return (__typeof__(v))FC_G_PERMUTE_PS(v, FC_G_IMM_PS(4, 1));      \
    case 18: return (__typeof__(v))FC_G_PERMUTE_PS(v, FC_G_IMM_PS(4, 2));      \
    case 19: return (__typeof__(v))FC_G_PERMUTE_PS(v, FC_G_IMM_PS(4, 3));      \
    FC_G_HALF_CASES_f32(v)                                                     \
    default: break;                                                            \
    }
#define FC_G_INLANE_f64(v, KG, i)                                              \
    switch ((KG) * 4 + (i)) {                                                  \
    case 8: return (__typeof__(v))FC_G_PERMUTE_PD(v, 0x00);                    \
    case 9: return (__typeof__(v))FC_G_PERMUTE_PD(v, 0xFF);                    \
    FC_G_HALF_CASES_f64(v)                                                     \
    default: break;                                                            \
    }
#else
#define FC_G_INLANE_f32(v, KG, i)
#define FC_G_INLANE_f64(v, KG, i)
#endif

#define FC_G_SHUFFLE_f32(v, m) FC_G_SHUFFLE(v, m)
#define FC_G_SHUFFLE_f64(v, m) FC_G_SHUFFLE(v, m)

#if !(defined(__GNUC__) && !defined(__clang__))
/* Compilers without GCC's __builtin_shuffle: lane by lane (the vector
 * subscripts are portable; clang vectorises the constant pattern). */
#define fc_g_shuffle_generic(v, m)                                             \
    ({                                                                         \
        __typeof__(v) fc_r_;                                                   \
        for (int fc_l_ = 0; fc_l_ < (int)(sizeof(v) / sizeof((v)[0]));         \
             fc_l_++)                                                          \
            fc_r_[fc_l_] = (v)[(m)[fc_l_]];                                    \
        fc_r_;                                                                 \
    })
#endif

FC_DEFINE_GROUPED(f32, float, int32_t)
FC_DEFINE_GROUPED(f64, double, int64_t)

/* The group widths the kernels are built for. */
static inline int fc_grouped_width_supported(ptrdiff_t KG)
{
    return KG == 2 || KG == 4 || KG == 8 || KG == 16;
}

#endif
