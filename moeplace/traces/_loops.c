/* Compiled loops of the trace statistics, each giving exactly what the numpy code it stands in for gives.
 *
 * count_planes: the stats pass's inner loop over a trace's expert-id byte planes (moeplace/traces/scan.py,
 * _reduce_planes), fused: per row, the deltas (low byte | high byte << 8) are summed into the sorted
 * expert ids, a zero delta after the first is reported as a repeated expert, a row whose largest id
 * reaches num_experts as an id out of range, and (when counts are given) each id adds one to its
 * (window, layer, expert) bin. One read of each plane, no intermediate arrays: numpy's version of the same
 * builds int64 keys slot by slot and bincounts them (several passes over memory per selection).
 *
 * On x86-64 the common top-16 runs on SSE2 (a row is one vector); other k and other CPUs run the scalar loop.
 *
 * Optional: the package falls back to that numpy version when this module was not built (no compiler at
 * install time) or is older than the Python code (ABI_VERSION). The limited C API (3.11) and the buffer
 * protocol only: no numpy headers, one build for every Python >= 3.11.
 */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ABI_VERSION 1

static inline uint32_t delta(const uint8_t *l, const uint8_t *h, Py_ssize_t i) {
    return h ? (uint32_t)l[i] | ((uint32_t)h[i] << 8) : l[i];
}

/* Whether the n bytes at p are all zero (the high plane of a batch whose deltas are all below 256). */
static int all_zero(const uint8_t *p, Py_ssize_t n) {
    uint8_t acc = 0;
    for (Py_ssize_t i = 0; i < n; i++) acc |= p[i];
    return acc == 0;
}

/* One row of count_planes (k ids, h NULL: no high plane): 1 when it repeats an expert, 2 when an id
 * reaches num_experts, else 0; each id adds one to its bin of c (NULL: check only) as it is summed, an id
 * past num_experts into bin 0 instead (never outside the counts: the caller discards them on a problem). */
static inline int count_row(const uint8_t *l, const uint8_t *h, Py_ssize_t k, uint32_t num_experts, int64_t *c) {
    uint32_t id = delta(l, h, 0), zero = 0;
    if (c) c[id < num_experts ? id : 0]++;
    for (Py_ssize_t i = 1; i < k; i++) {
        uint32_t d = delta(l, h, i);
        zero |= d == 0;  /* a zero delta after the first slot repeats an expert */
        id += d;
        if (c) c[id < num_experts ? id : 0]++;
    }
    return zero ? 1 : id >= num_experts ? 2 : 0;  /* the row's last id is its largest */
}

#if defined(__SSE2__)
#include <emmintrin.h>
/* count_row for k = 16 with SSE2: a row's 16 deltas are one vector; the repeat check is one compare,
 * the row's total (for the range check) two sums of absolute differences (exact: the high plane's sum
 * times 256 plus the low plane's), and the 16 ids the prefix sums of the deltas as 16-bit lanes (exact
 * for a row that passed the range check: every id is at most its total, below num_experts <= 65536). */
static inline int count_row_16(const uint8_t *l, const uint8_t *h, uint32_t num_experts, int64_t *c) {
    const __m128i zero = _mm_setzero_si128();
    __m128i lo = _mm_loadu_si128((const __m128i *)l);
    __m128i hi = h ? _mm_loadu_si128((const __m128i *)h) : zero;
    /* a zero delta (both bytes) after the first slot repeats an expert */
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_or_si128(lo, hi), zero)) & 0xFFFE) return 1;
    __m128i sl = _mm_sad_epu8(lo, zero), sh = _mm_sad_epu8(hi, zero);
    uint32_t total = (uint32_t)(_mm_cvtsi128_si32(sl) + _mm_extract_epi16(sl, 4)) +
                     ((uint32_t)(_mm_cvtsi128_si32(sh) + _mm_extract_epi16(sh, 4)) << 8);
    if (total >= num_experts) return 2;
    if (!c) return 0;
    __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);  /* 16-bit deltas */
    a = _mm_add_epi16(a, _mm_slli_si128(a, 2));
    b = _mm_add_epi16(b, _mm_slli_si128(b, 2));
    a = _mm_add_epi16(a, _mm_slli_si128(a, 4));
    b = _mm_add_epi16(b, _mm_slli_si128(b, 4));
    a = _mm_add_epi16(a, _mm_slli_si128(a, 8));
    b = _mm_add_epi16(b, _mm_slli_si128(b, 8));
    b = _mm_add_epi16(b, _mm_set1_epi16((short)_mm_extract_epi16(a, 7)));
    uint16_t ids[16];
    _mm_storeu_si128((__m128i *)ids, a);
    _mm_storeu_si128((__m128i *)(ids + 8), b);
    for (int i = 0; i < 16; i++) c[ids[i]]++;
    return 0;
}
#endif

/* Rows [r0, r1) of one window, row r0 at MoE layer layer0, visited layer by layer: a layer's E bins stay
 * in L1 while its rows pass, where row order would cycle the window's L x E bins (660 KB for K3) through
 * L2 at every row (measured: ~1.5x the time). The first problem found is returned. */
static inline int count_segment(const uint8_t *lp, const uint8_t *hp, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t k,
                                uint32_t num_experts, Py_ssize_t num_layers, Py_ssize_t layer0, int64_t *wbase) {
    Py_ssize_t layers = r1 - r0 < num_layers ? r1 - r0 : num_layers;
    for (Py_ssize_t off = 0; off < layers; off++) {
        Py_ssize_t layer = layer0 + off;
        if (layer >= num_layers) layer -= num_layers;
        int64_t *c = wbase ? wbase + layer * (Py_ssize_t)num_experts : NULL;
        for (Py_ssize_t r = r0 + off; r < r1; r += num_layers) {
            const uint8_t *h = hp ? hp + r * k : NULL;
            int status;
#if defined(__SSE2__)
            if (k == 16)
                status = count_row_16(lp + r * 16, h, num_experts, c);
            else
#endif
                status = count_row(lp + r * k, h, k, num_experts, c);
            if (status) return status;
        }
    }
    return 0;
}

/* count_planes's loop over n rows, window by window. */
static inline int count_rows(const uint8_t *lp, const uint8_t *hp, Py_ssize_t n, Py_ssize_t k,
                             Py_ssize_t num_experts, Py_ssize_t num_layers, Py_ssize_t first_row,
                             Py_ssize_t rows_per_window, Py_ssize_t first_window, int64_t *cp) {
    Py_ssize_t bins = num_layers * num_experts;
    for (Py_ssize_t r = 0; r < n;) {
        Py_ssize_t row = first_row + r;
        Py_ssize_t w = row / rows_per_window;
        Py_ssize_t end = (w + 1) * rows_per_window - first_row;  /* the window's end, in this batch's rows */
        if (end > n) end = n;
        int status = count_segment(lp, hp, r, end, k, (uint32_t)num_experts, num_layers, row % num_layers,
                                   cp ? cp + (w - first_window) * bins : NULL);
        if (status) return status;
        r = end;
    }
    return 0;
}

/* count_planes(lo, hi, k, num_experts, num_layers, first_row, rows_per_window, first_window, counts)
 *
 * lo, hi: C-contiguous buffers of n * k bytes (n rows of k deltas' low / high bytes; hi may be None:
 * all high bytes zero). Row r of the buffers is trace row first_row + r; its MoE-layer index is
 * (first_row + r) % num_layers and its window (first_row + r) / rows_per_window. counts: a writable
 * C-contiguous int64 buffer of windows * num_layers * num_experts bins, bin (w - first_window, layer,
 * id), or None to check only. Returns 0 when every row is valid, else the first problem found (in the
 * visiting order): 1, a row repeats an expert, or 2, a row has an id >= num_experts; the caller discards
 * the counts and re-checks the row group in the gate's order. Releases the GIL. */
static PyObject *count_planes(PyObject *self, PyObject *args) {
    PyObject *lo_obj, *hi_obj, *counts_obj;
    Py_ssize_t k, num_experts, num_layers, first_row, rows_per_window, first_window;
    if (!PyArg_ParseTuple(args, "OOnnnnnnO", &lo_obj, &hi_obj, &k, &num_experts, &num_layers, &first_row,
                          &rows_per_window, &first_window, &counts_obj))
        return NULL;
    if (k < 1 || num_experts < 1 || num_experts > 65536 || num_layers < 1 || first_row < 0 ||
        rows_per_window < 1 || first_window < 0 || first_row / rows_per_window < first_window) {
        PyErr_SetString(PyExc_ValueError, "count_planes: bad shape arguments");
        return NULL;
    }
    Py_buffer lo, hi, counts;
    int have_hi = hi_obj != Py_None, have_counts = counts_obj != Py_None;
    if (PyObject_GetBuffer(lo_obj, &lo, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (have_hi && PyObject_GetBuffer(hi_obj, &hi, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&lo);
        return NULL;
    }
    if (have_counts && PyObject_GetBuffer(counts_obj, &counts, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&lo);
        if (have_hi) PyBuffer_Release(&hi);
        return NULL;
    }
    Py_ssize_t n = lo.len / k;
    const char *bad = NULL;
    Py_ssize_t bins = num_layers * num_experts;
    if (lo.len % k) bad = "count_planes: the low plane is not whole rows of k bytes";
    else if (have_hi && hi.len != lo.len) bad = "count_planes: the planes differ in length";
    else if (have_counts && (counts.len % (Py_ssize_t)(bins * sizeof(int64_t)) ||
                             (uintptr_t)counts.buf % sizeof(int64_t)))
        bad = "count_planes: counts is not whole aligned int64 windows of num_layers x num_experts bins";
    else if (have_counts && n > 0 &&
             (first_row + n - 1) / rows_per_window - first_window >=
                 counts.len / (Py_ssize_t)(bins * sizeof(int64_t)))
        bad = "count_planes: the rows reach past the windows counts holds";
    if (bad) {
        PyBuffer_Release(&lo);
        if (have_hi) PyBuffer_Release(&hi);
        if (have_counts) PyBuffer_Release(&counts);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    const uint8_t *lp = (const uint8_t *)lo.buf;
    const uint8_t *hp = have_hi ? (const uint8_t *)hi.buf : NULL;
    int64_t *cp = have_counts ? (int64_t *)counts.buf : NULL;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    /* two copies of the loop: without the high plane when it is all zero (every delta below 256) */
    if (hp && !all_zero(hp, lo.len)) status = count_rows(lp, hp, n, k, num_experts, num_layers, first_row, rows_per_window, first_window, cp);
    else status = count_rows(lp, NULL, n, k, num_experts, num_layers, first_row, rows_per_window, first_window, cp);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&lo);
    if (have_hi) PyBuffer_Release(&hi);
    if (have_counts) PyBuffer_Release(&counts);
    return PyLong_FromLong(status);
}

/* The top k of a row's E distinct keys: the keys at or above the k-th largest, found with a min-heap of
 * the k largest seen so far (most keys fail the first comparison). */
static inline void sift_down(int64_t *heap, Py_ssize_t k, Py_ssize_t i) {
    for (;;) {
        Py_ssize_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < k && heap[l] < heap[m]) m = l;
        if (r < k && heap[r] < heap[m]) m = r;
        if (m == i) return;
        int64_t t = heap[i]; heap[i] = heap[m]; heap[m] = t;
        i = m;
    }
}

/* The row sums are 16 adds of E-wide rows: where the compiler can, a second copy for AVX2 (8 lanes, picked
 * at load time by the CPU; the default copy runs elsewhere), the same integer sums either way. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define ROW_SUMS_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef ROW_SUMS_CLONES
#define ROW_SUMS_CLONES
#endif

#define TOPK_ROWS(T)                                                                                       \
ROW_SUMS_CLONES static void topk_rows_##T(const T *c, const T *tie, const int32_t *src, const int32_t *dst, Py_ssize_t n,  \
                          Py_ssize_t k, Py_ssize_t E, int64_t *out, T *score, int64_t *heap) {               \
    for (Py_ssize_t r = 0; r < n; r++) {                                                                   \
        const int32_t *s = src + r * k, *d = dst + r * k;                                                  \
        memcpy(score, tie, E * sizeof(T));                                                                 \
        for (Py_ssize_t j = 0; j < k; j++) {                                                               \
            const T *row = c + (Py_ssize_t)s[j] * E;                                                       \
            for (Py_ssize_t e = 0; e < E; e++) score[e] += row[e];                                         \
        }                                                                                                  \
        for (Py_ssize_t i = 0; i < k; i++) heap[i] = score[i];                                             \
        for (Py_ssize_t i = k / 2; i-- > 0;) sift_down(heap, k, i);                                        \
        for (Py_ssize_t e = k; e < E; e++)                                                                 \
            if (score[e] > heap[0]) { heap[0] = score[e]; sift_down(heap, k, 0); }                         \
        int64_t found = 0;                                                                                 \
        for (Py_ssize_t j = 0; j < k; j++) found += (int64_t)score[d[j]] >= heap[0];                       \
        out[r] = found;                                                                                    \
    }                                                                                                      \
}
TOPK_ROWS(int32_t)
TOPK_ROWS(int64_t)

/* topk_hits(c, tie, src, dst, out): per row r of src / dst (int32 [n, k], ids in [0, E)), how many of
 * dst[r] are among the top k experts by key c[src[r, 0]] + ... + c[src[r, k-1]] + tie (c: int32 or int64
 * [E, E], tie: [E] of the same type; the keys of a row must be distinct, as measures._predict_hits makes
 * them). out: int64 [n]. Releases the GIL. */
static PyObject *topk_hits(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4])) return NULL;
    Py_buffer b[5];
    int flags[5] = {PyBUF_C_CONTIGUOUS | PyBUF_FORMAT, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT,
                    PyBUF_C_CONTIGUOUS | PyBUF_FORMAT, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT,
                    PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE};
    int got = 0;
    for (; got < 5; got++)
        if (PyObject_GetBuffer(objs[got], &b[got], flags[got]) < 0) break;
    const char *bad = NULL;
    Py_ssize_t isz = got == 5 ? b[0].itemsize : 0;
    if (got < 5) bad = "";
    else if ((isz != 4 && isz != 8) || b[1].itemsize != isz || b[0].ndim != 2 || b[0].shape[0] != b[0].shape[1] ||
             b[1].ndim != 1 || b[1].shape[0] != b[0].shape[0])
        bad = "topk_hits: c must be [E, E] and tie [E] of one integer type (int32 or int64)";
    else if (b[2].itemsize != 4 || b[3].itemsize != 4 || b[2].ndim != 2 || b[3].ndim != 2 ||
             b[2].shape[0] != b[3].shape[0] || b[2].shape[1] != b[3].shape[1] || b[2].shape[1] > b[0].shape[0])
        bad = "topk_hits: src and dst must be int32 [n, k] of one shape, k <= E";
    else if (b[4].itemsize != 8 || b[4].ndim != 1 || b[4].shape[0] != b[2].shape[0])
        bad = "topk_hits: out must be int64 [n]";
    Py_ssize_t E = 0, n = 0, k = 0;
    if (!bad) {
        E = b[0].shape[0], n = b[2].shape[0], k = b[2].shape[1];
        const int32_t *ids[2] = {(const int32_t *)b[2].buf, (const int32_t *)b[3].buf};
        for (int a = 0; a < 2 && !bad; a++)
            for (Py_ssize_t i = 0; i < n * k; i++)
                if (ids[a][i] < 0 || ids[a][i] >= E) { bad = "topk_hits: an id outside [0, E)"; break; }
    }
    void *score = NULL;
    int64_t *heap = NULL;
    if (!bad && k > 0) {
        score = PyMem_Malloc(E * isz);
        heap = PyMem_Malloc(k * sizeof(int64_t));
        if (!score || !heap) bad = "topk_hits: out of memory";
    }
    if (!bad && k > 0) {
        Py_BEGIN_ALLOW_THREADS
        if (isz == 4)
            topk_rows_int32_t((const int32_t *)b[0].buf, (const int32_t *)b[1].buf, (const int32_t *)b[2].buf,
                              (const int32_t *)b[3].buf, n, k, E, (int64_t *)b[4].buf, score, heap);
        else
            topk_rows_int64_t((const int64_t *)b[0].buf, (const int64_t *)b[1].buf, (const int32_t *)b[2].buf,
                              (const int32_t *)b[3].buf, n, k, E, (int64_t *)b[4].buf, score, heap);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(score);
    PyMem_Free(heap);
    for (int i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    if (bad) {
        if (*bad) PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"count_planes", count_planes, METH_VARARGS,
     "count_planes(lo, hi, k, num_experts, num_layers, first_row, rows_per_window, first_window, counts)"
     " -> 0 (valid), 1 (a repeated expert) or 2 (an id out of range); see moeplace/traces/_planes.c"},
    {"topk_hits", topk_hits, METH_VARARGS,
     "topk_hits(c, tie, src, dst, out): per row, how many dst ids are among the top k by summed key;"
     " see moeplace/traces/_loops.c"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_loops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__loops(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
