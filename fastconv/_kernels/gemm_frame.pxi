# Goto/BLIS-style GEMM: one source for every ISA build.
#
# Included by the thin per-ISA modules (gemm_avx512.pyx, gemm_avx2.pyx,
# gemm_baseline.pyx).  Before the include, each defines in a verbatim C block
# the macros that micro_kernel.h documents (FC_VBYTES and the float32/float64
# tiles FC_S_MR x FC_S_NR, FC_D_MR x FC_D_NR) and the blocking FC_{S,D}_KC
# (depth of a packed B block) and FC_{S,D}_NC (its width); and ISA_NAME.
#
# C is computed as alpha*A@B + beta*C for arbitrary element strides on all
# three operands (transposes and negative strides are just strides), so the
# Python facade never copies an operand to fix its layout.
#
# Loop nest: jc over N by NC -> pc over K by KC -> pack the KC x NC block of
# B into NR-column panels (all threads) -> one task per thread: a share of
# the MR panels of A and/or of the NR panels of B -> ir over MR panels of A
# (read in place, see macro_kernel) -> jr over NR panels -> micro-kernel.
# The micro-kernel broadcasts one A element into NR/VL vectors of B, so C
# tiles are stored along contiguous rows.  With ir outside jr, the MR x KC
# slice of A stays in L1 while the B panels stream from L2 (a KC x NC block
# is sized to half an L2).

from libc.stdlib cimport malloc, free
from cython.parallel cimport prange

cdef extern from "micro_kernel.h":
    enum:
        S_MR "FC_S_MR"
        S_PAIR_MR "FC_S_PAIR_MR"
        S_NR "FC_S_NR"
        S_KC "FC_S_KC"
        S_NC "FC_S_NC"
        D_MR "FC_D_MR"
        D_NR "FC_D_NR"
        D_KC "FC_D_KC"
        D_NC "FC_D_NC"
    enum:
        OUT_ADD "FC_OUT_ADD"
        OUT_STREAM "FC_OUT_STREAM"
    # The micro-kernels (micro_kernel.h): a tile finished into out, rows
    # rso apart (flags FC_OUT_ADD, FC_OUT_STREAM; bias; act).
    # fc_micro_kernel prefetches (into L2) its rows' values pf bytes on as it
    # goes (pf 0: none).
    void fc_micro_kernel_f32(int mr, Py_ssize_t kc, const float* a, Py_ssize_t rsa,
                             Py_ssize_t pf, const float* b, float* out, Py_ssize_t rso,
                             int flags, const float* bias, int act) noexcept nogil
    void fc_micro_kernel_f64(int mr, Py_ssize_t kc, const double* a, Py_ssize_t rsa,
                             Py_ssize_t pf, const double* b, double* out, Py_ssize_t rso,
                             int flags, const double* bias, int act) noexcept nogil
    void fc_shared_runs_kernel_f32(int mr, Py_ssize_t nruns, const Py_ssize_t* run_off,
                                   const float* const* pix, Py_ssize_t kc, const float* b,
                                   float* out, Py_ssize_t rso, int flags, const float* bias,
                                   int act) noexcept nogil
    void fc_shared_runs_kernel_f64(int mr, Py_ssize_t nruns, const Py_ssize_t* run_off,
                                   const double* const* pix, Py_ssize_t kc, const double* b,
                                   double* out, Py_ssize_t rso, int flags, const double* bias,
                                   int act) noexcept nogil
    void fc_shared_runs_pair_kernel_f32(int mr, Py_ssize_t nruns, const Py_ssize_t* run_off,
                                        const float* const* pix, Py_ssize_t kc, const float* b,
                                        const float* b2, float* out, Py_ssize_t rso, int flags,
                                        const float* bias, int act) noexcept nogil
    void fc_micro_pair_kernel_f32(int mr, Py_ssize_t kc, const float* a, Py_ssize_t rsa,
                                  Py_ssize_t pf, const float* b, const float* b2, float* out,
                                  Py_ssize_t rso, int flags, const float* bias,
                                  int act) noexcept nogil
    float fc_dot_f32(const float* a, const float* x, Py_ssize_t n) noexcept nogil
    void fc_pack_bt_f32(Py_ssize_t kc, Py_ssize_t nr, const float* b, Py_ssize_t csb,
                        float* dst) noexcept nogil
    void fc_pack_bt_f64(Py_ssize_t kc, Py_ssize_t nr, const double* b, Py_ssize_t csb,
                        double* dst) noexcept nogil
    # at[j*ldt + i] = a[i*rsa + j], a block of at most 64 bytes of rows by
    # as many of columns, through an L1 tile.
    void fc_transpose_block_f32(Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t j0, Py_ssize_t j1,
                                const float* a, Py_ssize_t rsa, float* at,
                                Py_ssize_t ldt) noexcept nogil
    void fc_transpose_block_f64(Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t j0, Py_ssize_t j1,
                                const double* a, Py_ssize_t rsa, double* at,
                                Py_ssize_t ldt) noexcept nogil
    # fc_kmajor_kernel: A.T views (values of a k contiguous, k lda apart);
    # B's panel values of a k contiguous, k ldb apart (NR: packed).
    void fc_kmajor_kernel_f32(int mr, Py_ssize_t kc, const float* a, Py_ssize_t lda,
                              const float* b, Py_ssize_t ldb, float* out,
                              Py_ssize_t rso, int flags, const float* bias, int act,
                              Py_ssize_t pfa, Py_ssize_t pfb) noexcept nogil
    void fc_kmajor_kernel_f64(int mr, Py_ssize_t kc, const double* a, Py_ssize_t lda,
                              const double* b, Py_ssize_t ldb,
                              double* out, Py_ssize_t rso, int flags, const double* bias,
                              int act, Py_ssize_t pfa, Py_ssize_t pfb) noexcept nogil
    double fc_dot_f64(const double* a, const double* x, Py_ssize_t n) noexcept nogil
    void fc_prefetch_rows(const void* p, Py_ssize_t nrows, Py_ssize_t row_stride,
                          Py_ssize_t row_bytes) noexcept nogil
    void fc_prefetchw_rows(void* p, Py_ssize_t nrows, Py_ssize_t row_stride,
                           Py_ssize_t row_bytes) noexcept nogil
    void fc_stream_row_f32(float* dst, const float* src, Py_ssize_t n, float alpha,
                           const float* bias, int act) noexcept nogil
    void fc_stream_row_f64(double* dst, const double* src, Py_ssize_t n, double alpha,
                           const double* bias, int act) noexcept nogil
    void fc_store_fence() noexcept nogil

cdef extern from "short_m_kernel.h":
    enum:
        VBYTES "FC_VBYTES"
        S_SHORT_MR "FC_S_SHORT_MR"
        S_SHORT_NV "FC_S_SHORT_NV"
        D_SHORT_MR "FC_D_SHORT_MR"
        D_SHORT_NV "FC_D_SHORT_NV"
    # C (M x N) = A @ W^T for M of at most nv vectors (+ the extra row):
    # W's rows (ldw apart) read in place, A^T packed in at (see the header).
    void fc_short_m_kernel_f32(int nv, int extra, Py_ssize_t K, const float* w,
                               Py_ssize_t ldw, Py_ssize_t R, const float* at,
                               const float* xe, Py_ssize_t M, float* c, Py_ssize_t rsc,
                               Py_ssize_t csc, float alpha, float beta, const float* bias,
                               int act) noexcept nogil
    void fc_short_m_kernel_f64(int nv, int extra, Py_ssize_t K, const double* w,
                               Py_ssize_t ldw, Py_ssize_t R, const double* at,
                               const double* xe, Py_ssize_t M, double* c, Py_ssize_t rsc,
                               Py_ssize_t csc, double alpha, double beta, const double* bias,
                               int act) noexcept nogil

ctypedef fused real:
    float
    double

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define FASTCONV_HAVE_OPENMP 1
    #else
    #define FASTCONV_HAVE_OPENMP 0
    static int omp_get_max_threads(void) { return 1; }
    #endif
    """
    int omp_get_max_threads() noexcept nogil
    int FASTCONV_HAVE_OPENMP

# Below this many flops a parallel region costs more than it saves.
cdef enum:
    MIN_FLOPS_PER_THREAD = 2000000
    MAX_TILE = S_MR * S_NR + D_MR * D_NR
    # Fused epilogues (the codes the Python entry points take).
    ACT_NONE = 0
    ACT_RELU = 1
    ACT_RELU6 = 2
    # A copied slice's rows are kc + 16 elements apart, never a multiple of
    # the L1 set stride.
    A_PANEL_PAD = 16
    MAX_PANEL = S_MR * (S_KC + 16) + D_MR * (D_KC + 16)
    # macro_kernel_ld multiplies pairs of B panels (S_PAIR_MR x 2 NR tiles)
    # for K blocks up to this deep; see there.
    PAIR_MAX_KC = 128
    # gemm_nogil and the weight gradient read B in place (not packed) next
    # to an A.T view for B of at most this many bytes a row (b_in_place_ok;
    # 1 KiB rows, 256->256 @14, measured no better).
    B_IN_PLACE_MAX_BYTES = 512
    # How many k ahead an A.T view's tiles (and a B read in place beside
    # them) prefetch their own values as they walk k, where the caller says
    # both stream from memory (macro_kernel_ld's stream_ahead).  16, 24, 32
    # and 64 measured alike (1x1 256->64 @56 b8 weight gradient).
    KMAJOR_PF_ROWS = 32
    # The short-M path's packed A^T stays within half an L2.  Its products
    # are at least SHORT_M_MIN_K deep: each tile ends in a scalar
    # transposed store of its R x M sums, which shallower ones do not pay
    # for (Zen 4, 2 threads, 49 rows, best ms frame -> short-M: K x N 64 x
    # 256 0.022 -> 0.028, 128 x 512 0.039 -> 0.044, 256 x 256 0.039 ->
    # 0.041, 384 x 384 a tie; 512 x 256 0.076 -> 0.073, 512 x 512 0.145 ->
    # 0.131, 2048 x 512 0.569 -> 0.485).
    SHORT_M_MAX_AT_BYTES = 512 * 1024
    SHORT_M_MIN_K = 512
    SHORT_M_MAX_ROWS = 49

ISA = ISA_NAME
HAVE_OPENMP = bool(FASTCONV_HAVE_OPENMP)
TILE_F32 = (S_MR, S_NR)
TILE_F64 = (D_MR, D_NR)
BLOCKING_F32 = {"KC": S_KC, "NC": S_NC}
BLOCKING_F64 = {"KC": D_KC, "NC": D_NC}


cdef extern from "workspace.h":
    void* fc_ws_alloc(size_t nbytes) noexcept nogil
    void fc_ws_free(void* p) noexcept nogil
    size_t fc_ws_release_cache() noexcept nogil
    size_t fc_ws_cached_bytes() noexcept nogil


cdef inline void* aligned_malloc(size_t nbytes) noexcept nogil:
    # 64-byte aligned; large blocks come from (and go back to) the cache of
    # workspace.h, which spares each call re-faulting its workspace in.
    return fc_ws_alloc(nbytes)


cdef inline void aligned_free(void* p) noexcept nogil:
    fc_ws_free(p)


# Largest B that gemm packs whole before multiplying (see gemm_nogil).  A
# variable so that tests can drive the block-at-a-time path with small B.
cdef Py_ssize_t pack_all_bytes = 8 * 1024 * 1024


# A C larger than this, written in one K block, is stored with non-temporal
# stores (see macro_kernel_ld): past one L2 (1 MiB on the machines
# measured), its lines are evicted before anyone reads them.  1 MiB rather
# than 4: Zen 5, in one process alternating, best GFLOPS 2 threads, outputs
# of 0.8-3.2 MB: 3136x256x64 414 -> 461 (1 thread 222 -> 245), 3136x128x64
# 416 -> 462, 784x1024x256 443 -> 466, 1x1 64->256 @56 b1 427 -> 469, 7x7/2
# stem b1 430 -> 451, 1x1/2 256->512 @56 b1 456 -> 467, depthwise 3x3 32
# @112 b1 129 -> 138; no layer of bench_conv slower; ResNet-18 b1 and b8
# and a 1x1-3x3-1x1 bottleneck (whose next layer reads the output) within
# the noise (bottleneck b1 0.665 -> 0.650 ms median).  512 KiB gained 0-3 %
# more on outputs of 0.8 MB but slowed the bottleneck (0.683 ms).  A
# variable so that tests can drive the streaming path with small products.
cdef Py_ssize_t stream_bytes = 1024 * 1024


def set_stream_bytes(Py_ssize_t nbytes):
    """Set the size above which a one-K-block GEMM streams C (tests only:
    not thread-safe); returns the previous value."""
    global stream_bytes
    previous = stream_bytes
    stream_bytes = max(0, nbytes)
    return previous


# Whether gemm takes the short-M path where it applies (short_m_rows).  A
# variable so that tests and benchmarks can run the frame instead.
cdef bint short_m_enabled = True


def set_short_m(bint enabled):
    """Turn the short-M path on or off (tests only: not thread-safe);
    returns the previous setting."""
    global short_m_enabled
    previous = short_m_enabled
    short_m_enabled = enabled
    return previous


def set_pack_all_bytes(Py_ssize_t nbytes):
    """Set the whole-B packing budget (tests only: not thread-safe); returns
    the previous value."""
    global pack_all_bytes
    previous = pack_all_bytes
    pack_all_bytes = max(0, nbytes)
    return previous


def release_workspace():
    """Free the cached workspace blocks of this build; returns the bytes
    released."""
    return fc_ws_release_cache()


def cached_workspace_bytes():
    return fc_ws_cached_bytes()


cdef class WorkspaceBlock:
    # A block of the workspace cache lent to a numpy array (as the base
    # of np.frombuffer): it goes back to the cache when the array is gone,
    # so the next large output of a loop of calls is served without
    # faulting its pages in again (see fastconv.gemm.empty_aligned).
    cdef void* ptr
    cdef Py_ssize_t nbytes

    def __cinit__(self, Py_ssize_t nbytes):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive (got {nbytes})")
        self.ptr = aligned_malloc(nbytes)
        if self.ptr == NULL:
            raise MemoryError(f"cannot allocate {nbytes} bytes")
        self.nbytes = nbytes

    def __getbuffer__(self, Py_buffer* view, int flags):
        view.buf = self.ptr
        view.obj = self
        view.len = self.nbytes
        view.readonly = 0
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = &self.nbytes
        view.strides = &view.itemsize
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer* view):
        pass

    def __dealloc__(self):
        aligned_free(self.ptr)


cdef inline Py_ssize_t cdiv(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return (a + b - 1) // b


cdef inline Py_ssize_t share_start(Py_ssize_t s, Py_ssize_t n, Py_ssize_t ways) noexcept nogil:
    # Where share s starts when n units are dealt `ways` ways as evenly as
    # they go (sizes differ by at most one unit).
    return s * n // ways


cdef inline double share_efficiency(Py_ssize_t units, Py_ssize_t ways) noexcept nogil:
    # Fraction of ways x (largest share) that is real work when `units`
    # indivisible units are dealt out `ways` ways.
    return units / <double>(ways * cdiv(units, ways))


cdef inline void store_tile(const real* acc, Py_ssize_t nr_full,
                            real* c, Py_ssize_t rsc, Py_ssize_t csc,
                            Py_ssize_t mr, Py_ssize_t nr,
                            real alpha, real beta, bint first,
                            const real* bias, int act) noexcept nogil:
    # First K block: C = alpha*acc + beta*C (+ bias[j] when bias is given;
    # beta == 0 never reads C, so NaN in C is overwritten as BLAS does).
    # Later K blocks accumulate.  act (ACT_RELU, ACT_RELU6), given with the
    # last K block only, clamps the finished tile while it is in L1.
    cdef Py_ssize_t i, j
    cdef real* crow
    cdef const real* arow
    for i in range(mr):
        crow = c + i * rsc
        arow = acc + i * nr_full
        if csc == 1 and not first:
            for j in range(nr):
                crow[j] += alpha * arow[j]
        elif csc == 1 and beta == 0 and bias == NULL:
            for j in range(nr):
                crow[j] = alpha * arow[j]
        elif csc == 1 and beta == 0:
            for j in range(nr):
                crow[j] = alpha * arow[j] + bias[j]
        else:
            for j in range(nr):
                if not first:
                    crow[j * csc] += alpha * arow[j]
                elif beta == 0:
                    crow[j * csc] = alpha * arow[j]
                else:
                    crow[j * csc] = alpha * arow[j] + beta * crow[j * csc]
                if first and bias != NULL:
                    crow[j * csc] += bias[j]
    if act != ACT_NONE:
        clamp_tile(c, rsc, csc, mr, nr, act)


cdef inline bint can_stream(Py_ssize_t M, Py_ssize_t N, Py_ssize_t n_kb, real beta,
                            Py_ssize_t rsc, Py_ssize_t csc) noexcept nogil:
    # Whether C (M x N, rows rsc apart) goes out with non-temporal stores:
    # past stream_bytes, so its lines would leave the L2s before anyone
    # reads them, written once (one K block, beta == 0, nothing to read
    # back), and with rows that start on vector boundaries.
    return (n_kb == 1 and beta == 0 and csc == 1
            and M * N * <Py_ssize_t>sizeof(real) > stream_bytes
            and (rsc * <Py_ssize_t>sizeof(real)) % 64 == 0)


cdef inline void write_tile(const real* acc, Py_ssize_t nr_full,
                            real* c, Py_ssize_t rsc, Py_ssize_t csc,
                            Py_ssize_t mr, Py_ssize_t nr,
                            real alpha, real beta, bint first,
                            const real* bias, int act, bint stream) noexcept nogil:
    # store_tile, or, for a full tile of a streamed C (can_stream) that
    # starts on a vector boundary, the same epilogue with non-temporal
    # stores.  A thread that streamed calls fc_store_fence before its task
    # ends.
    cdef Py_ssize_t i
    if stream and nr == nr_full and (<size_t>c) % 64 == 0:
        for i in range(mr):
            if real is float:
                fc_stream_row_f32(c + i * rsc, acc + i * nr_full, nr_full, alpha, bias, act)
            else:
                fc_stream_row_f64(c + i * rsc, acc + i * nr_full, nr_full, alpha, bias, act)
    else:
        store_tile(acc, nr_full, c, rsc, csc, mr, nr, alpha, beta, first, bias, act)


cdef inline int tile_out_flags(Py_ssize_t nr, Py_ssize_t nr_full, const real* c,
                               Py_ssize_t csc, real alpha, real beta, bint first,
                               bint stream) noexcept nogil:
    # The flags with which a micro-kernel finishes this tile straight into
    # C (fc_micro_kernel: full width, unit column stride, alpha 1, beta
    # 0 or 1, or a later K block), streamed as write_tile would; -1 for a
    # tile that goes through a stack tile and write_tile.
    if nr != nr_full or csc != 1 or alpha != 1 or (first and beta != 0 and beta != 1):
        return -1
    if stream and (<size_t>c) % 64 == 0:
        return OUT_STREAM
    return 0 if first and beta == 0 else OUT_ADD


cdef inline void clamp_tile(real* c, Py_ssize_t rsc, Py_ssize_t csc, Py_ssize_t mr,
                            Py_ssize_t nr, int act) noexcept nogil:
    # relu: max(v, 0); relu6: min(max(v, 0), 6).  NaN stays NaN, as in torch.
    cdef Py_ssize_t i, j
    cdef real v
    for i in range(mr):
        for j in range(nr):
            v = c[i * rsc + j * csc]
            if v < 0:
                v = 0
            elif act == ACT_RELU6 and v > 6:
                v = 6
            c[i * rsc + j * csc] = v


cdef inline int threads_for(double flops, int max_threads) noexcept nogil:
    # Never more threads than the work pays for.
    cdef int nt = max_threads if max_threads > 1 else 1
    if flops < <double>MIN_FLOPS_PER_THREAD * nt:
        nt = max(1, <int>(flops / MIN_FLOPS_PER_THREAD))
    return nt


cdef inline void block_sizes(real dtype_tag, Py_ssize_t K, Py_ssize_t N,
                             Py_ssize_t* kc_blk, Py_ssize_t* nc_blk) noexcept nogil:
    # Depth and width of a packed B block for a K x N operand.  Equal K
    # blocks avoid a short, inefficient last one.
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t KC = S_KC if real is float else D_KC
    cdef Py_ssize_t NC = S_NC if real is float else D_NC
    kc_blk[0] = cdiv(K, cdiv(K, KC)) if K > KC else K
    nc_blk[0] = min(max(NC // NR, 1) * NR, cdiv(N, NR) * NR)


cdef inline void best_split(Py_ssize_t units_a, Py_ssize_t units_b, int nt,
                            Py_ssize_t* ways_a, Py_ssize_t* ways_b) noexcept nogil:
    # ways_a * ways_b == nt, choosing the split that wastes least to uneven
    # shares (ties go to splitting a).
    cdef Py_ssize_t d
    cdef double eff, best = -1.0
    ways_a[0] = nt
    ways_b[0] = 1
    for d in range(1, nt + 1):
        if nt % d == 0:
            eff = share_efficiency(units_a, nt // d) * share_efficiency(units_b, d)
            if eff > best + 1e-9:
                best = eff
                ways_a[0] = nt // d
                ways_b[0] = d


cdef void pack_b_panel(Py_ssize_t kc, Py_ssize_t nr, const real* b,
                       Py_ssize_t rsb, Py_ssize_t csb, real* dst) noexcept nogil:
    # B[0:kc, 0:nr] -> kc rows of NR contiguous values, zero past nr.
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t p, j
    cdef const real* src
    if csb == 1 and nr == NR:
        for p in range(kc):
            src = b + p * rsb
            for j in range(NR):
                dst[p * NR + j] = src[j]
    elif rsb == 1:
        # B = W^T with W's rows contiguous (conv weights, trans_b).
        if real is float:
            fc_pack_bt_f32(kc, nr, b, csb, dst)
        else:
            fc_pack_bt_f64(kc, nr, b, csb, dst)
    else:
        for p in range(kc):
            src = b + p * rsb
            for j in range(nr):
                dst[p * NR + j] = src[j * csb]
            for j in range(nr, NR):
                dst[p * NR + j] = 0


cdef void pack_b_rows(Py_ssize_t kc, Py_ssize_t ncols, const real* b, Py_ssize_t rsb,
                      real* dst) noexcept nogil:
    # B[0:kc, 0:ncols] (unit column stride) -> cdiv(ncols, NR) panels as
    # pack_b_panel lays them out, one after another.  Row by row, all
    # panels at once: a panel at a time would read NR-wide strips of every
    # row, a strided walk the hardware prefetcher follows poorly when B
    # comes from memory (pack_b_panel took 22 % of a 1x1 weight gradient).
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef Py_ssize_t n_full = ncols // NR, tail = ncols - n_full * NR
    cdef Py_ssize_t p, jp, j
    cdef const real* src
    cdef real* d
    for p in range(kc):
        src = b + p * rsb
        if p + 4 < kc:
            fc_prefetch_rows(src + 4 * rsb, 1, 0, ncols * sizeof(real))
        for jp in range(n_full):
            d = dst + jp * NR * kc + p * NR
            for j in range(NR):
                d[j] = src[jp * NR + j]
        if tail:
            d = dst + n_full * NR * kc + p * NR
            for j in range(tail):
                d[j] = src[n_full * NR + j]
            for j in range(tail, NR):
                d[j] = 0


cdef void copy_a_panel(Py_ssize_t mr, Py_ssize_t kc, const real* a,
                       Py_ssize_t rsa, Py_ssize_t csa, real* dst) noexcept nogil:
    # A[0:mr, 0:kc] -> row-major with leading dimension kc + A_PANEL_PAD.
    cdef Py_ssize_t ld = kc + A_PANEL_PAD
    cdef Py_ssize_t i, p
    if csa == 1:
        for i in range(mr):
            for p in range(kc):
                dst[i * ld + p] = a[i * rsa + p]
    else:
        for p in range(kc):
            for i in range(mr):
                dst[i * ld + p] = a[i * rsa + p * csa]


cdef inline void macro_kernel(Py_ssize_t mc, Py_ssize_t nc, Py_ssize_t kc,
                              Py_ssize_t jp0, Py_ssize_t jp1,
                              const real* a, Py_ssize_t rsa, Py_ssize_t csa,
                              const real* bpack, real* c, Py_ssize_t rsc, Py_ssize_t csc,
                              real alpha, real beta, bint first, const real* bias,
                              int act, Py_ssize_t next_kc, bint pairs=False) noexcept nogil:
    # B's NR panels packed kc deep, one after another.
    macro_kernel_ld(mc, nc, kc, kc, jp0, jp1, a, rsa, csa, bpack, c, rsc, csc, alpha, beta,
                    first, bias, act, False, next_kc, pairs)


cdef void macro_kernel_ld(Py_ssize_t mc, Py_ssize_t nc, Py_ssize_t kc, Py_ssize_t ldb,
                          Py_ssize_t jp0, Py_ssize_t jp1,
                          const real* a, Py_ssize_t rsa, Py_ssize_t csa,
                          const real* bpack, real* c, Py_ssize_t rsc, Py_ssize_t csc,
                          real alpha, real beta, bint first, const real* bias,
                          int act, bint stream, Py_ssize_t next_kc,
                          bint pairs=False, Py_ssize_t rsb_in_place=0,
                          bint stream_ahead=False) noexcept nogil:
    # One thread's task: its mc x kc block of A times the NR panels jp0..jp1
    # of the packed B block (panel jp at bpack + jp*NR*ldb), or, with
    # rsb_in_place (A.T views only, see gemm_nogil), of B itself: panel jp
    # at bpack + jp*NR, rows rsb_in_place apart.  A row-major A is not
    # packed into k-major panels
    # (see micro_kernel.h): the micro-kernel reads MR rows in place as fast as a
    # packed panel (the MR x kc slice stays in L1 across the jr loop).  Two
    # layouts defeat that and get a plain row-major copy of the slice first
    # (under 1 % of the work): rows a multiple of 2 KiB apart, which all fall
    # in a few L1 sets (8-way on the CPUs we target; measured 12 % slower at
    # N = 1024 and 2048), and non-unit strides both ways.  A.T views (unit
    # row stride: a weight gradient's dy^T) are read in place too, k-major,
    # by fc_kmajor_kernel.  acc and the copy live on this thread's stack.
    #
    # While a slice is multiplied, the next slice of A and the next C tiles
    # are prefetched into L2 (see fc_prefetch_rows), the C tiles only when C
    # is not streamed (see can_stream and write_tile), a share of their rows
    # before each panel: issued all at once, ~400 lines a slice at 2048^3,
    # the prefetches filled the miss queue and stalled (perf: 11 % of the
    # samples on them and on the next copy).  An A read in place is asked
    # for by the first panel's micro-kernel instead, a line of each row as
    # it walks k (pf): with few panels even a share was a burst (1x1
    # 256->64 @56 b8, 2 panels: 96 lines each, 6 % of the samples on the
    # prefetch at 2 threads).  Measured in alternating processes: that
    # layer 143-174 -> 194-203 GFLOPS on 2 threads, 1 thread sgemm 2048^3
    # 89-93 -> 90-98, 4096x512x4096 87-93 -> 94-103, 64->256 unchanged.
    # An A.T view's tiles read mr values from each of kc rows: a walk across
    # rows that the hardware prefetcher follows poorly (the k-major copies
    # this frame once made stalled on memory for a quarter of a 1x1 weight
    # gradient), so each tile
    # prefetches its share of the next K block's rows (next_kc of them; 0:
    # none), whole.  With stream_ahead (operands that come from memory, not
    # from a buffer this thread just built) its kernel also asks, at each
    # k, for the values KMAJOR_PF_ROWS k on, of A and of a B read in place:
    # a 1x1 weight gradient's image and dy (x^T @ dy) at batch 8, 32 MB
    # read once, went 5.3-5.6 -> 4.0-4.2 ms (Zen 4, 2 threads).
    cdef Py_ssize_t MR = S_MR if real is float else D_MR
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef real acc[MAX_TILE]
    cdef real panel[MAX_PANEL]
    # An A.T view whose k rows are a multiple of 2 KiB apart puts a tile's
    # kc values of k (one line each) in two L1 sets: every broadcast missed
    # L1, once per NR panel.  Such slices are copied row-major like the
    # others (once per slice), unless the caller streams A from memory
    # (stream_ahead: the kernel's own prefetch k rows ahead, which the copy
    # would lose: 1x1 512->128 @28 b8, patches on the left, 15-20 % slower
    # copied).  Zen 3, 2 threads, weight gradients alone, in one process
    # alternating, best / median ms in place -> copied: 1x1 2048->512 @7 b8
    # 7.25 / 9.27 -> 6.44 / 8.54 and 8.74 / 9.26 -> 6.15 / 7.90, 512->2048
    # @7 b8 (dy^T @ x by gemm_nogil) medians 11.5 -> 8.5, 12.0 -> 8.6, 1x1/2
    # 1024->2048 @14 b8 26.0 -> 20.4, 26.6 -> 20.5, 3x3/2 256->512 @14 b8
    # 9.19 -> 8.36, 9.86 -> 8.12; batch 1 (shallow chunks) within noise.
    # Streamed 1 KiB rows (four sets; 1x1 64->256 @56 b8, dy^T @ x) lost
    # copied too: 7.3-9.1 -> 10.0-15.6 best.  Unstreamed slices at 1 KiB
    # were not measured, so the copy stays at 2 KiB multiples.
    cdef bint at_view = csa != 1 and rsa == 1
    cdef bint kmajor_sets = (at_view and not stream_ahead
                             and (csa * <Py_ssize_t>sizeof(real)) % 2048 == 0)
    cdef bint kmajor_a = at_view and not kmajor_sets
    cdef bint copy_a = not kmajor_a and (csa != 1
                                         or (rsa * <Py_ssize_t>sizeof(real)) % 2048 == 0)
    cdef bint in_place_a = not kmajor_a and not copy_a
    cdef const real* ap
    cdef real* ct
    cdef Py_ssize_t ip, ir, jp, jr, mr, next_rows, pr0, pr1, ars = kc + A_PANEL_PAD if copy_a else rsa
    cdef Py_ssize_t rso, pf, n_pan, half
    cdef Py_ssize_t bstep = NR if rsb_in_place == 0 else rsb_in_place
    cdef Py_ssize_t panel_step = ldb if rsb_in_place == 0 else 1
    cdef real* out
    # write_tile adds the bias with the first K block only.
    cdef const real* tile_bias = bias if first else NULL
    cdef const real* out_bias
    cdef int flags, out_act
    # Row tiles of equal size (within one row), as in multiply_pixel_rows:
    # M = 49 as 9 + 4 x 10, not 4 x 12 + 1.
    cdef Py_ssize_t n_tiles = cdiv(mc, MR)
    cdef Py_ssize_t pf_a = KMAJOR_PF_ROWS * csa * sizeof(real) if kmajor_a and stream_ahead else 0
    cdef Py_ssize_t pf_b = KMAJOR_PF_ROWS * bstep * sizeof(real) if pf_a and rsb_in_place else 0
    for ip in range(n_tiles):
        ir = share_start(ip, mc, n_tiles)
        mr = share_start(ip + 1, mc, n_tiles) - ir
        next_rows = share_start(ip + 2, mc, n_tiles) - (ir + mr) if ip + 1 < n_tiles else 0
        ap = a + ir * rsa
        if at_view and next_kc > 0:
            fc_prefetch_rows(a + (kc + share_start(ip, next_kc, n_tiles)) * csa,
                             share_start(ip + 1, next_kc, n_tiles)
                             - share_start(ip, next_kc, n_tiles),
                             csa * sizeof(real), mc * sizeof(real))
            if rsb_in_place:
                # and of B's rows, read in place as well
                fc_prefetch_rows(bpack + (kc + share_start(ip, next_kc, n_tiles)) * bstep
                                 + jp0 * NR,
                                 share_start(ip + 1, next_kc, n_tiles)
                                 - share_start(ip, next_kc, n_tiles),
                                 bstep * sizeof(real), (min(nc, jp1 * NR) - jp0 * NR) * sizeof(real))
        if copy_a:
            copy_a_panel(mr, kc, ap, rsa, csa, panel)
            ap = panel
        jp = jp0
        while jp < jp1:
            jr = jp * NR
            ct = c + ir * rsc + jr * csc
            # Finished by the kernel into C, or into acc for write_tile.
            flags = tile_out_flags(min(NR, nc - jr), NR, ct, csc, alpha, beta, first, stream)
            # pairs (the caller's choice) on a build with paired kernels
            # (S_PAIR_MR): two full B panels at once where A has rows and the
            # block is shallow, for which the 12 x 32 tile stores its 12 rows
            # after few k steps.  Zen 5, 2 threads, in one process
            # alternating, best GFLOPS 12x32 -> pairs of 6x64: 12544x128x64
            # 492 -> 515, 3136x256x64 479 -> 497, 6272x512x128 516 -> 521;
            # 1x1 64->256 @56 b8 (gemm1x1) 477 -> 506, the input gradients
            # of 1x1 256->64 @56 (K = 64) b1 473 -> 492, b8 480 -> 501.
            # Deeper blocks gained nothing (3136x256x192, 784x1024x256) or
            # lost (2048^3 -5 % median: the pair's 2 x kc x NR panel is read
            # from L2 for every 6 rows), as did A.T views (a 1x1 weight
            # gradient dy^T @ x, 64->256 @56 b8, -22 %) and Winograd's
            # products (3x3 128->128 @28 b8 -10 %; its callers pass False).
            n_pan = 1
            if (real is float and S_PAIR_MR > 0 and pairs and not kmajor_a
                    and kc <= PAIR_MAX_KC and jp + 1 < jp1 and nc - jr >= 2 * NR
                    and flags >= 0):
                n_pan = 2
            pf = 0
            if next_rows > 0:
                # These panels' share of the next slice's rows.
                pr0 = ir + mr + share_start(jp - jp0, next_rows, jp1 - jp0)
                pr1 = ir + mr + share_start(jp - jp0 + n_pan, next_rows, jp1 - jp0)
                if in_place_a:
                    # The first panel's kernel asks for them as it goes
                    # (see above; when the next slice is a row shorter, for
                    # one row past it: a prefetch never faults); a next
                    # slice one row taller gets its last row from here.
                    if jp == jp0:
                        pf = mr * rsa * sizeof(real)
                        if next_rows > mr:
                            fc_prefetch_rows(a + (ir + 2 * mr) * rsa, next_rows - mr,
                                             rsa * sizeof(real), kc * sizeof(real))
                elif csa == 1:          # row-major A, copied (copy_a)
                    fc_prefetch_rows(a + pr0 * rsa, pr1 - pr0, rsa * sizeof(real),
                                     kc * sizeof(real))
                if csc == 1 and not stream:
                    fc_prefetchw_rows(c + pr0 * rsc + jp0 * NR, pr1 - pr0, rsc * sizeof(real),
                                      (min(nc, jp1 * NR) - jp0 * NR) * sizeof(real))
            if n_pan == 2:
                # Two full panels at once, the slice's rows in two halves:
                # each row of A is read once per 2*NR columns of C.
                if real is float:
                    out_bias = NULL if tile_bias == NULL else tile_bias + jr
                    half = (mr + 1) // 2
                    fc_micro_pair_kernel_f32(half, kc, ap, ars, pf, bpack + jr * ldb,
                                             bpack + (jr + NR) * ldb, ct, rsc, flags, out_bias,
                                             act)
                    if mr > half:
                        fc_micro_pair_kernel_f32(mr - half, kc, ap + half * ars, ars, pf,
                                                 bpack + jr * ldb, bpack + (jr + NR) * ldb,
                                                 ct + half * rsc, rsc, flags, out_bias, act)
                jp += 2
                continue
            if flags >= 0:
                out, rso, out_act = ct, rsc, act
                out_bias = NULL if tile_bias == NULL else tile_bias + jr
            else:
                out, rso, flags, out_bias, out_act = acc, NR, 0, NULL, ACT_NONE
            if real is float:
                if kmajor_a:
                    fc_kmajor_kernel_f32(mr, kc, ap, csa, bpack + jr * panel_step, bstep, out,
                                         rso, flags, out_bias, out_act, pf_a, pf_b)
                else:
                    fc_micro_kernel_f32(mr, kc, ap, ars, pf, bpack + jr * ldb, out, rso,
                                        flags, out_bias, out_act)
            else:
                if kmajor_a:
                    fc_kmajor_kernel_f64(mr, kc, ap, csa, bpack + jr * panel_step, bstep, out,
                                         rso, flags, out_bias, out_act, pf_a, pf_b)
                else:
                    fc_micro_kernel_f64(mr, kc, ap, ars, pf, bpack + jr * ldb, out, rso,
                                        flags, out_bias, out_act)
            if out == acc:
                write_tile(acc, NR, ct, rsc, csc, mr, min(NR, nc - jr), alpha, beta, first,
                           NULL if bias == NULL else bias + jr, act, stream)
            jp += 1
    if stream:
        fc_store_fence()


cdef inline void finish_gemv_value(real v, real* y, real alpha, real beta, const real* bias,
                                   int act) noexcept nogil:
    # y = act(alpha*v + beta*y (+ bias)), never reading y when beta == 0.
    v = alpha * v
    if beta != 0:
        v = v + beta * y[0]
    if bias != NULL:
        v = v + bias[0]
    if act != ACT_NONE and v < 0:
        v = 0
    elif act == ACT_RELU6 and v > 6:
        v = 6
    y[0] = v


cdef int gemv_nogil(Py_ssize_t M, Py_ssize_t K, real alpha,
                    const real* a, Py_ssize_t sai, Py_ssize_t sak,
                    const real* x, Py_ssize_t sx, real beta, real* y, Py_ssize_t sy,
                    const real* bias, Py_ssize_t sbias, int act, int max_threads) noexcept nogil:
    # y[i] = act(alpha * sum_k a[i, k] x[k] + beta*y[i] (+ bias[i*sbias])):
    # a product with one output row or column, memory-bound, which the
    # packed-panel GEMM would run at 1/NR of its width after packing a
    # whole operand.  Rows of a with unit k stride are dot products
    # (fc_dot); a with unit i stride is swept column by column (axpy form,
    # vectorised over i).  Each y[i] is summed by one thread in a fixed
    # order: results do not depend on the thread count.  Returns -1 when
    # out of memory.
    cdef int nt = threads_for(2.0 * M * K, max_threads)
    cdef bint dot_form = sak == 1 or sai != 1
    cdef real* xc = <real*>x
    cdef real* acc = NULL
    if sx != 1:
        xc = <real*>aligned_malloc(K * sizeof(real))
    if not dot_form:
        acc = <real*>aligned_malloc(M * sizeof(real))
    if xc == NULL or (not dot_form and acc == NULL):
        if sx != 1:
            aligned_free(xc)
        aligned_free(acc)
        return -1
    cdef Py_ssize_t i, k, t, i0, i1
    cdef real v
    cdef const real* row
    if sx != 1:
        for k in range(K):
            xc[k] = x[k * sx]
    if dot_form:
        for i in prange(M, num_threads=nt, schedule="static"):
            row = a + i * sai
            if sak == 1:
                if real is float:
                    v = fc_dot_f32(row, xc, K)
                else:
                    v = fc_dot_f64(row, xc, K)
            else:
                v = 0
                for k in range(K):
                    v = v + row[k * sak] * xc[k]
            finish_gemv_value(v, y + i * sy, alpha, beta,
                              NULL if bias == NULL else bias + i * sbias, act)
    else:
        # Blocks of 1,024 rows keep each thread's acc slice in L1 while it
        # sweeps the K columns.
        for t in prange(cdiv(M, 1024), num_threads=nt, schedule="static"):
            i0 = t * 1024
            i1 = min(M, i0 + 1024)
            for i in range(i0, i1):
                acc[i] = 0
            for k in range(K):
                row = a + k * sak
                v = xc[k]
                for i in range(i0, i1):
                    acc[i] += row[i] * v
            for i in range(i0, i1):
                finish_gemv_value(acc[i], y + i * sy, alpha, beta,
                                  NULL if bias == NULL else bias + i * sbias, act)
    if sx != 1:
        aligned_free(xc)
    aligned_free(acc)
    return 0


cdef inline bint b_in_place_ok(Py_ssize_t N, Py_ssize_t rsb, real dtype_tag) noexcept nogil:
    # Whether N columns of B (unit column stride, rows rsb apart) next to an
    # A.T view are read in place rather than packed (see gemm_nogil).  Not
    # rows 0 apart (every row the same memory, np.broadcast_to): a zero row
    # stride is macro_kernel_ld's mark of a packed B, and AVX-512 read such
    # a B as packed panels, past its end (found by fuzzing).
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    return (rsb != 0 and N % NR == 0 and N * <Py_ssize_t>sizeof(real) <= B_IN_PLACE_MAX_BYTES
            and NR * <Py_ssize_t>sizeof(real) >= 128)


cdef inline Py_ssize_t short_m_rows(real dtype_tag) noexcept nogil:
    # The most rows of A the short-M path takes (0: no such kernels in this
    # build): a 7x7 image at batch 1, in blocks of the kernels' vectors.
    if real is float:
        return SHORT_M_MAX_ROWS if S_SHORT_MR > 0 else 0
    else:
        return SHORT_M_MAX_ROWS if D_SHORT_MR > 0 else 0


cdef inline int short_m_vectors(Py_ssize_t M, Py_ssize_t vl, int* extra) noexcept nogil:
    # How the short-M kernels hold M rows of A: vectors of vl rows, row
    # M - 1 riding as the extra row (extra[0] = 1) when the rows before it
    # fill whole vectors.
    extra[0] = (M - 1) % vl == 0
    return <int>cdiv(M - extra[0], vl)


cdef inline bint short_m_applies(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                                 Py_ssize_t csa, Py_ssize_t rsb, real dtype_tag) noexcept nogil:
    # A short A with contiguous rows times W^T with W's rows contiguous
    # (B = W^T: unit row stride), where W outweighs A (N >= M), deep
    # enough products (K >= SHORT_M_MIN_K), and A^T packed within half an
    # L2 (the kernel has no K blocks).
    cdef int extra
    cdef int nv = short_m_vectors(M, VBYTES // sizeof(real), &extra)
    return (short_m_enabled and 2 <= M <= short_m_rows(<real>0) and N >= M
            and K >= SHORT_M_MIN_K and csa == 1 and rsb == 1
            and K * nv * <Py_ssize_t>VBYTES <= SHORT_M_MAX_AT_BYTES)


def short_m_gemm_applies(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, dtype):
    """Whether gemm runs an (M x K) @ (K x N) product of row-major A and a
    transposed row-major B (a 1x1 convolution's) by the short-M kernels."""
    if dtype == "float32":
        return short_m_applies(M, N, K, 1, 1, <float>0)
    return short_m_applies(M, N, K, 1, 1, <double>0)


cdef inline Py_ssize_t short_m_block_rows(real dtype_tag) noexcept nogil:
    # Rows of A a short-M kernel call takes: the build's short NV vectors.
    if real is float:
        return S_SHORT_NV * (VBYTES // 4)
    else:
        return D_SHORT_NV * (VBYTES // 8)


cdef inline Py_ssize_t short_m_packed_size(Py_ssize_t M, Py_ssize_t K,
                                           real dtype_tag) noexcept nogil:
    # Values of A^T as short_m_pack packs it: K rows of M's vectors.
    cdef int extra
    cdef Py_ssize_t vl = VBYTES // sizeof(real)
    return K * short_m_vectors(M, vl, &extra) * vl


cdef void short_m_pack(Py_ssize_t M, Py_ssize_t K, const real* a, Py_ssize_t rsa, real* at,
                       Py_ssize_t kb0, Py_ssize_t kb1) noexcept nogil:
    # A (M x K, rows rsa apart) -> at for the short-M kernels, lines kb0 to
    # kb1 of k (a line: 64 bytes of each row): blocks of
    # short_m_block_rows rows, each K rows of its own vectors (the last
    # block's padded with zeros), block b at at + K * b * block_rows; the
    # extra row (short_m_vectors) is left out, read in place.
    cdef Py_ssize_t vl = VBYTES // sizeof(real)
    cdef Py_ssize_t tb = 64 // sizeof(real)
    cdef Py_ssize_t block_rows = short_m_block_rows(<real>0)
    cdef int extra
    cdef int nv = short_m_vectors(M, vl, &extra)
    cdef Py_ssize_t rows = M - extra
    cdef Py_ssize_t kb, k0, k1, b, m0, rb, ldb, ib, i0, k, m
    cdef real* atb
    for kb in range(kb0, kb1):
        k0 = kb * tb
        k1 = min(K, k0 + tb)
        for b in range(cdiv(nv * vl, block_rows)):
            m0 = b * block_rows
            rb = min(rows - m0, block_rows)
            ldb = min(nv * vl - m0, block_rows)
            atb = at + K * m0
            for ib in range(cdiv(rb, tb)):
                i0 = ib * tb
                if real is float:
                    fc_transpose_block_f32(i0, min(rb, i0 + tb), k0, k1, a + m0 * rsa, rsa,
                                           atb, ldb)
                else:
                    fc_transpose_block_f64(i0, min(rb, i0 + tb), k0, k1, a + m0 * rsa, rsa,
                                           atb, ldb)
            for k in range(k0, k1):
                for m in range(rb, ldb):
                    atb[k * ldb + m] = 0


cdef void short_m_multiply(Py_ssize_t M, Py_ssize_t K, const real* at, const real* a_last,
                           const real* w, Py_ssize_t ldw, Py_ssize_t R, real alpha, real beta,
                           real* c, Py_ssize_t rsc, Py_ssize_t csc, const real* bias,
                           int act) noexcept nogil:
    # C (M x R) = alpha * A @ W^T + beta * C (+ bias, act) for R (at most
    # the build's short MR) rows of W, ldw apart: a kernel call per block
    # of at (short_m_pack's), the last block's with A's row M - 1 (a_last,
    # contiguous) as the extra row where short_m_vectors says so.
    cdef Py_ssize_t vl = VBYTES // sizeof(real)
    cdef Py_ssize_t block_rows = short_m_block_rows(<real>0)
    cdef int extra
    cdef int nv = short_m_vectors(M, vl, &extra)
    cdef Py_ssize_t rows = M - extra
    cdef Py_ssize_t n_mb = cdiv(nv * vl, block_rows), b, m0
    cdef bint last
    for b in range(n_mb):
        m0 = b * block_rows
        last = b == n_mb - 1
        if real is float:
            fc_short_m_kernel_f32(cdiv(min(nv * vl - m0, block_rows), vl), extra if last else 0,
                                  K, w, ldw, R, at + K * m0, a_last,
                                  min(rows - m0, block_rows) + (extra if last else 0),
                                  c + m0 * rsc, rsc, csc, alpha, beta, bias, act)
        else:
            fc_short_m_kernel_f64(cdiv(min(nv * vl - m0, block_rows), vl), extra if last else 0,
                                  K, w, ldw, R, at + K * m0, a_last,
                                  min(rows - m0, block_rows) + (extra if last else 0),
                                  c + m0 * rsc, rsc, csc, alpha, beta, bias, act)


cdef int gemm_short_m(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, real alpha,
                      const real* a, Py_ssize_t rsa, const real* w, Py_ssize_t ldw,
                      real beta, real* c, Py_ssize_t rsc, Py_ssize_t csc,
                      const real* bias, int act, int max_threads) noexcept nogil:
    # C = alpha * A @ W^T + beta * C (+ bias, act) by the short-M kernels
    # (short_m_kernel.h): A^T packed (its row M - 1 rides as the extra row
    # when the rows before it fill whole vectors), then tiles of the
    # build's short MR rows of W dealt out to the threads.  A kernel call
    # takes the build's short NV vectors of rows: more run as blocks of
    # them (short_m_pack, short_m_multiply), a tile's W rows read from
    # memory for the first block and from L2 for the others.
    cdef Py_ssize_t tb = 64 // sizeof(real)
    cdef Py_ssize_t smr = S_SHORT_MR if real is float else D_SHORT_MR
    cdef int nt = threads_for(2.0 * M * N * K, max_threads)
    cdef Py_ssize_t kb, t, n0
    cdef real* at = <real*>aligned_malloc(short_m_packed_size(M, K, <real>0) * sizeof(real))
    if at == NULL:
        return -1
    # A line of k a task: whole lines of A's rows in, whole lines of at out.
    for kb in prange(cdiv(K, tb), num_threads=nt, schedule="static"):
        short_m_pack(M, K, a, rsa, at, kb, kb + 1)
    for t in prange(cdiv(N, smr), num_threads=nt, schedule="static"):
        n0 = t * smr
        short_m_multiply(M, K, at, a + (M - 1) * rsa, w + n0 * ldw, ldw, min(smr, N - n0),
                         alpha, beta, c + n0 * csc, rsc, csc,
                         NULL if bias == NULL else bias + n0, act)
    aligned_free(at)
    return 0


cdef int gemm_nogil(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, real alpha,
                    const real* a, Py_ssize_t rsa, Py_ssize_t csa,
                    const real* b, Py_ssize_t rsb, Py_ssize_t csb,
                    real beta, real* c, Py_ssize_t rsc, Py_ssize_t csc,
                    const real* bias, int act, int max_threads) noexcept nogil:
    """C[M,N] = alpha*A[M,K]@B[K,N] + beta*C (+ bias[N] broadcast over rows,
    when not NULL).  Returns 0, or -1 when out of memory (C is then
    untouched).  Requires M, N, K >= 1."""
    if N == 1:      # C's one column = A @ b[:, 0]; a bias over N is one value
        return gemv_nogil(M, K, alpha, a, rsa, csa, b, rsb, beta, c, rsc, bias, 0, act,
                          max_threads)
    if M == 1:      # C's one row = B^T @ a[0, :]
        return gemv_nogil(N, K, alpha, b, csb, rsb, a, csa, beta, c, csc, bias, 1, act,
                          max_threads)
    if short_m_applies(M, N, K, csa, rsb, <real>0):
        return gemm_short_m(M, N, K, alpha, a, rsa, b, csb, beta, c, rsc, csc, bias, act,
                            max_threads)
    cdef Py_ssize_t MR = S_MR if real is float else D_MR
    cdef Py_ssize_t NR = S_NR if real is float else D_NR
    cdef int nt = threads_for(2.0 * M * N * K, max_threads)
    cdef Py_ssize_t kc_blk, nc_blk
    block_sizes(<real>0, K, N, &kc_blk, &nc_blk)
    # One task per thread: the MR panels of A split n_ic ways and the NR
    # panels of each B block n_js ways; a short M (M = 49 at the end of a
    # ResNet) is better split along N.
    cdef Py_ssize_t m_panels = cdiv(M, MR), n_ic, n_js
    best_split(m_panels, cdiv(nc_blk, NR), nt, &n_ic, &n_js)

    cdef Py_ssize_t n_jb = cdiv(N, nc_blk), n_kb = cdiv(K, kc_blk)
    cdef Py_ssize_t panels_per_blk = nc_blk // NR
    # A B of up to pack_all_bytes is packed whole in one parallel region
    # and multiplied in a second: two thread-team wake-ups per call instead
    # of two per KC x NC block (32 for K = 2048, N = 512, where the barriers
    # cost ~13 % at batch-1 sizes).  A larger B is packed a block at a time
    # into one L2-sized buffer, the Goto way.
    cdef bint pack_all = K * N * <Py_ssize_t>sizeof(real) <= pack_all_bytes
    # B read in place, not packed: for an A.T view (k-major A; a weight
    # gradient's dy^T) times a narrow B whose rows hold whole panels, such
    # as a 1x1 weight gradient's image.  Packing it was a pass of its own
    # over memory (15 % of the samples of 64->256 @56 b8) for panels that
    # the k-major tiles read from L2 either way (a kc x NR panel and A's kc
    # rows overflow L1 together).  Where a panel's k row is two lines or
    # more (AVX-512): Zen 5, 2 threads, one process alternating, best/median
    # GFLOPS of the weight gradient packed -> in place: 1x1 64->256 @56 b1
    # 352/343 -> 427/422, b8 322/311 -> 327/312, 32->256 b1 287/284 ->
    # 412/407, b8 258/221 -> 321/288, float64 32->256 b1 163/159 ->
    # 174/172; 128 wide (128->512 @28, in alternating processes) b1
    # 414-432 -> 443, b8 434-449 -> 465-471.  With AVX2's one-line rows
    # and 6-row tiles (B's lines read from L2 by twice as many tiles)
    # 64->256 b1 lost 218 -> 184.
    cdef bint b_in_place = (rsa == 1 and csa != 1 and csb == 1
                            and b_in_place_ok(N, rsb, <real>0))
    cdef bint stream = can_stream(M, N, n_kb, beta, rsc, csc)
    cdef real* bbuf = NULL
    if not b_in_place:
        bbuf = <real*>aligned_malloc(
            (n_jb * n_kb if pack_all else 1) * kc_blk * nc_blk * sizeof(real))
        if bbuf == NULL:
            return -1

    cdef Py_ssize_t jblk, jc, pblk, pc, nc, kc, n_panels, jp, task, ic, ic_end, js, t
    cdef bint first

    if pack_all or b_in_place:
        if not b_in_place:
            # A task per NR columns, every K block in order: a transposed B
            # is then read as NR long row streams (see pack_b_blocks_into).
            for t in prange(n_jb * panels_per_blk, num_threads=nt, schedule="static"):
                jblk = t // panels_per_blk
                jp = t % panels_per_blk
                jc = jblk * nc_blk + jp * NR
                if jc < N:
                    for pblk in range(n_kb):
                        pc = pblk * kc_blk
                        pack_b_panel(min(kc_blk, K - pc), min(NR, N - jc),
                                     b + pc * rsb + jc * csb, rsb, csb,
                                     bbuf + ((jblk * n_kb + pblk) * nc_blk + jp * NR) * kc_blk)
        for task in prange(n_ic * n_js, num_threads=nt, schedule="static"):
            ic = min(M, share_start(task // n_js, m_panels, n_ic) * MR)
            ic_end = min(M, share_start(task // n_js + 1, m_panels, n_ic) * MR)
            js = task % n_js
            if ic_end > ic:
                for jblk in range(n_jb):
                    jc = jblk * nc_blk
                    nc = min(nc_blk, N - jc)
                    n_panels = cdiv(nc, NR)
                    for pblk in range(n_kb):
                        pc = pblk * kc_blk
                        # Panels of a short last K block sit kc_blk apart.
                        macro_kernel_ld(ic_end - ic, nc, min(kc_blk, K - pc),
                                        1 if b_in_place else kc_blk,
                                        share_start(js, n_panels, n_js),
                                        share_start(js + 1, n_panels, n_js),
                                        a + ic * rsa + pc * csa, rsa, csa,
                                        b + pc * rsb + jc if b_in_place
                                        else bbuf + (jblk * n_kb + pblk) * nc_blk * kc_blk,
                                        c + ic * rsc + jc * csc, rsc, csc, alpha, beta,
                                        pblk == 0, NULL if bias == NULL else bias + jc,
                                        act if pblk == n_kb - 1 else ACT_NONE, stream,
                                        0 if pblk == n_kb - 1 else min(kc_blk, K - pc - kc_blk),
                                        True, rsb if b_in_place else 0)
        aligned_free(bbuf)
        return 0

    for jblk in range(n_jb):
        jc = jblk * nc_blk
        nc = min(nc_blk, N - jc)
        n_panels = cdiv(nc, NR)
        for pblk in range(n_kb):
            pc = pblk * kc_blk
            kc = min(kc_blk, K - pc)
            first = pc == 0
            for jp in prange(n_panels, num_threads=nt, schedule="static"):
                pack_b_panel(kc, min(NR, nc - jp * NR), b + pc * rsb + (jc + jp * NR) * csb,
                             rsb, csb, bbuf + jp * NR * kc)
            for task in prange(n_ic * n_js, num_threads=nt, schedule="static"):
                ic = min(M, share_start(task // n_js, m_panels, n_ic) * MR)
                ic_end = min(M, share_start(task // n_js + 1, m_panels, n_ic) * MR)
                js = task % n_js
                if ic_end > ic:
                    macro_kernel(ic_end - ic, nc, kc,
                                 share_start(js, n_panels, n_js),
                                 share_start(js + 1, n_panels, n_js),
                                 a + ic * rsa + pc * csa, rsa, csa, bbuf,
                                 c + ic * rsc + jc * csc, rsc, csc, alpha, beta, first,
                                 NULL if bias == NULL else bias + jc,
                                 act if pblk == n_kb - 1 else ACT_NONE,
                                 0 if pblk == n_kb - 1 else min(kc_blk, K - pc - kc_blk),
                                 True)
    aligned_free(bbuf)
    return 0


def gemm(double alpha, const real[:, :] a, const real[:, :] b, double beta,
         real[:, :] c, int num_threads, bias=None, int activation=ACT_NONE):
    """c[...] = act(alpha * a @ b + beta * c (+ bias, a contiguous (N,)
    array, broadcast over rows)), in place; any strides.  activation:
    ACT_NONE, ACT_RELU or ACT_RELU6.

    The facade has checked shapes, dtypes and emptiness (M, N, K >= 1) and
    that c does not overlap a or b.
    """
    cdef Py_ssize_t M = a.shape[0], K = a.shape[1], N = b.shape[1]
    cdef Py_ssize_t item = sizeof(real)
    cdef const real[::1] bias_view
    cdef const real* bias_ptr = NULL
    if bias is not None:
        bias_view = bias
        bias_ptr = &bias_view[0]
    cdef int status
    with nogil:
        status = gemm_nogil(M, N, K, <real>alpha,
                            &a[0, 0], a.strides[0] // item, a.strides[1] // item,
                            &b[0, 0], b.strides[0] // item, b.strides[1] // item,
                            <real>beta, &c[0, 0], c.strides[0] // item, c.strides[1] // item,
                            bias_ptr, activation, num_threads)
    if status != 0:
        raise MemoryError("fastconv gemm: could not allocate packing buffers")


def narrow_output_gemm_applies(Py_ssize_t P, Py_ssize_t OC, Py_ssize_t K, dtype):
    """Whether narrow_output_gemm runs a (P x K) @ (K x OC) product: builds
    with short-M kernels, 2 to one vector of output channels, at most
    pixels, and w^T packed within half an L2."""
    cdef Py_ssize_t item = 4 if dtype == "float32" else 8
    cdef Py_ssize_t rows = (short_m_rows(<float>0) if dtype == "float32"
                            else short_m_rows(<double>0))
    return (short_m_enabled and rows > 0 and 2 <= OC <= VBYTES // item and P >= OC
            and K * <Py_ssize_t>VBYTES <= SHORT_M_MAX_AT_BYTES)


def narrow_output_gemm(const real[:, ::1] x, const real[:, ::1] w, double beta, real[:, :] y,
                       int num_threads, int activation=ACT_NONE):
    """y[...] = act(x @ w.T + beta * y) for few output channels (w: OC x K,
    narrow_output_gemm_applies): the short-M kernels with the roles
    swapped, y^T = w @ x^T.  The frame's register tiles are 32 outputs wide
    (3 of them used by an RGB output layer); here w^T is packed into one
    vector of output channels a k and x's rows are read in place as the
    broadcast operand, each FMA finishing one pixel's OC sums (Zen 4, 2
    threads, best ms, frame -> these: (50176 x 64) @ (64 x 3) 1.08 -> 0.51,
    x 8 1.08 -> 0.58, (3136 x 256) @ (256 x 15) 0.261 -> 0.137, (12544 x
    256) @ (256 x 5) 0.96 -> 0.49; numpy 0.45, 0.53, 0.27, 0.56)."""
    cdef Py_ssize_t P = x.shape[0], K = x.shape[1], OC = w.shape[0]
    cdef Py_ssize_t item = sizeof(real)
    if w.shape[1] != K or y.shape[0] != P or y.shape[1] != OC:
        raise ValueError(f"narrow_output_gemm: shapes {tuple(x.shape)[:2]}, "
                         f"{tuple(w.shape)[:2]}, {tuple(y.shape)[:2]} do not match")
    if not narrow_output_gemm_applies(P, OC, K, "float32" if real is float else "float64"):
        raise ValueError(f"narrow_output_gemm does not apply to {OC} output channels, K {K}")
    cdef int status
    with nogil:
        status = gemm_short_m(OC, P, K, <real>1, &w[0, 0], w.strides[0] // item,
                              &x[0, 0], x.strides[0] // item, <real>beta, &y[0, 0],
                              y.strides[1] // item, y.strides[0] // item, NULL, activation,
                              num_threads)
    if status != 0:
        raise MemoryError("fastconv gemm: could not allocate packing buffers")


def max_threads():
    return omp_get_max_threads()
