/* The two hot loops of a cold agent turn's analysis, in C (optional: gateway/analysis falls back
 * to Python and tiktoken when this module is not built).
 *
 * cbor_block(parent, tokens, start, end, extra) -> bytes
 *     The canonical CBOR of (parent, tuple(tokens[start:end]), extra), the input of vLLM's
 *     sha256_cbor block hash; `tokens` a buffer of C ints (array("i")), `extra` already CBOR.
 *
 * chain_hashes(sha256, parent, tokens, first, last, block_size, extra0, extra) -> (raw, hashes)
 *     vLLM's sha256_cbor block hashes of blocks [first, last) of `tokens`, chained from
 *     `parent`: each digest is sha256(cbor_block(parent, tokens, i*bs, (i+1)*bs, x)) with x
 *     `extra0` for block 0 and `extra` after, and becomes the next block's parent. `sha256` is
 *     the address of OpenSSL's one-shot SHA256() (the libcrypto hashlib runs on, checked against
 *     hashlib by the caller). raw: the digests (bytes); hashes: the 64-bit external hash of each
 *     (its last 8 bytes, big-endian), as ints. One call per turn instead of one Python
 *     iteration (a CBOR call, a hashlib object, a digest, an int) per block.
 *
 * Encoder(ranks, kind, classes).encode(text) -> list[int]   (.encode_bytes: as array("I") bytes)
 *     Byte-level BPE, as tiktoken's CoreBPE.encode_ordinary: the text is split by a
 *     pre-tokenizer regex (kind 0: GPT-2's; 1: Llama 3's; 2: Qwen 2's, the same with single
 *     digits), hand-written here as a scanner, then each piece's UTF-8 bytes are merged by rank
 *     (the lowest-ranked adjacent pair first, leftmost on a tie). `ranks` maps token bytes to
 *     rank; `classes` has one byte per code point: 1 letter (\p{L}), 2 number (\p{N}),
 *     4 white space (\s), 8 unassigned (a text with one raises ValueError: the caller encodes
 *     it another way, as the regex engines may know code points newer than Python's Unicode
 *     data). The caller checks the result against the model's own tokenizer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* -- CBOR ------------------------------------------------------------------------------------ */

static unsigned char *put_head(unsigned char *p, int major, uint64_t n) {
    major <<= 5;
    if (n < 24) {
        *p++ = (unsigned char)(major | n);
    } else if (n < 256) {
        *p++ = (unsigned char)(major | 24);
        *p++ = (unsigned char)n;
    } else if (n < 65536) {
        *p++ = (unsigned char)(major | 25);
        *p++ = (unsigned char)(n >> 8);
        *p++ = (unsigned char)n;
    } else if (n < 4294967296ULL) {
        *p++ = (unsigned char)(major | 26);
        for (int s = 24; s >= 0; s -= 8) *p++ = (unsigned char)(n >> s);
    } else {
        *p++ = (unsigned char)(major | 27);
        for (int s = 56; s >= 0; s -= 8) *p++ = (unsigned char)(n >> s);
    }
    return p;
}

static PyObject *cbor_block(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer parent, extra, toks;
    PyObject *tokobj;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "y*Onny*", &parent, &tokobj, &start, &end, &extra)) return NULL;
    PyObject *out = NULL;
    if (PyObject_GetBuffer(tokobj, &toks, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) goto done_pe;
    if (toks.itemsize != sizeof(int) || toks.format == NULL || strcmp(toks.format, "i") != 0) {
        PyErr_SetString(PyExc_TypeError, "tokens must be an array('i')");
        goto done;
    }
    Py_ssize_t n = toks.len / (Py_ssize_t)sizeof(int);
    if (start < 0 || end < start || end > n) {
        PyErr_SetString(PyExc_IndexError, "block out of range");
        goto done;
    }
    Py_ssize_t count = end - start;
    Py_ssize_t cap = 1 + 9 + parent.len + 9 + 9 * count + extra.len;
    out = PyBytes_FromStringAndSize(NULL, cap);
    if (out == NULL) goto done;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    unsigned char *p0 = p;
    *p++ = 0x83; /* array(3) */
    p = put_head(p, 2, (uint64_t)parent.len);
    memcpy(p, parent.buf, (size_t)parent.len);
    p += parent.len;
    p = put_head(p, 4, (uint64_t)count);
    const int *t = (const int *)toks.buf + start;
    for (Py_ssize_t i = 0; i < count; i++) {
        int v = t[i];
        p = v >= 0 ? put_head(p, 0, (uint64_t)v) : put_head(p, 1, (uint64_t)(-1 - (int64_t)v));
    }
    memcpy(p, extra.buf, (size_t)extra.len);
    p += extra.len;
    if (_PyBytes_Resize(&out, p - p0) < 0) out = NULL;
done:
    PyBuffer_Release(&toks);
done_pe:
    PyBuffer_Release(&parent);
    PyBuffer_Release(&extra);
    return out;
}

typedef unsigned char *(*sha256_fn)(const unsigned char *, size_t, unsigned char *);

static PyObject *chain_hashes(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long fn_addr;
    Py_buffer parent, extra0, extra, toks;
    PyObject *tokobj;
    Py_ssize_t first, last, bs;
    if (!PyArg_ParseTuple(args, "Ky*Onnny*y*", &fn_addr, &parent, &tokobj, &first, &last, &bs, &extra0,
                          &extra))
        return NULL;
    PyObject *raw = NULL, *hashes = NULL, *out = NULL;
    unsigned char *buf = NULL;
    sha256_fn sha = (sha256_fn)(uintptr_t)fn_addr;
    if (PyObject_GetBuffer(tokobj, &toks, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) goto done_pe;
    if (toks.itemsize != sizeof(int) || toks.format == NULL || strcmp(toks.format, "i") != 0) {
        PyErr_SetString(PyExc_TypeError, "tokens must be an array('i')");
        goto done;
    }
    Py_ssize_t n = toks.len / (Py_ssize_t)sizeof(int);
    if (sha == NULL || bs <= 0 || first < 0 || last < first || last * bs > n || parent.len > 64) {
        PyErr_SetString(PyExc_ValueError, "bad chain_hashes arguments");
        goto done;
    }
    Py_ssize_t ex = extra0.len > extra.len ? extra0.len : extra.len;
    buf = PyMem_Malloc((size_t)(1 + 9 + 64 + 9 + 9 * bs + ex));
    raw = PyList_New(last - first);
    hashes = PyList_New(last - first);
    if (buf == NULL || raw == NULL || hashes == NULL) {
        if (buf == NULL) PyErr_NoMemory();
        goto done;
    }
    unsigned char digest[32];
    const unsigned char *par = (const unsigned char *)parent.buf;
    Py_ssize_t plen = parent.len;
    for (Py_ssize_t i = first; i < last; i++) {
        unsigned char *p = buf;
        *p++ = 0x83; /* array(3) */
        p = put_head(p, 2, (uint64_t)plen);
        memcpy(p, par, (size_t)plen);
        p += plen;
        p = put_head(p, 4, (uint64_t)bs);
        const int *t = (const int *)toks.buf + i * bs;
        for (Py_ssize_t j = 0; j < bs; j++) {
            int v = t[j];
            p = v >= 0 ? put_head(p, 0, (uint64_t)v) : put_head(p, 1, (uint64_t)(-1 - (int64_t)v));
        }
        const Py_buffer *x = i == 0 ? &extra0 : &extra;
        memcpy(p, x->buf, (size_t)x->len);
        p += x->len;
        sha(buf, (size_t)(p - buf), digest);
        PyObject *d = PyBytes_FromStringAndSize((const char *)digest, 32);
        if (d == NULL) goto done;
        PyList_SET_ITEM(raw, i - first, d);
        uint64_t h = 0;
        for (int k = 24; k < 32; k++) h = (h << 8) | digest[k];
        PyObject *hv = PyLong_FromUnsignedLongLong(h);
        if (hv == NULL) goto done;
        PyList_SET_ITEM(hashes, i - first, hv);
        par = (const unsigned char *)PyBytes_AS_STRING(d);
        plen = 32;
    }
    out = PyTuple_Pack(2, raw, hashes);
done:
    PyBuffer_Release(&toks);
done_pe:
    PyMem_Free(buf);
    Py_XDECREF(raw);
    Py_XDECREF(hashes);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&extra0);
    PyBuffer_Release(&extra);
    return out;
}

/* -- the rank table -------------------------------------------------------------------------- */

typedef struct {
    uint32_t off; /* into the key pool */
    uint32_t len; /* 0: empty slot */
    uint32_t rank;
} Slot;

static inline uint64_t hash_bytes(const unsigned char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 1099511628211ULL;
    }
    return h ^ (h >> 29);
}

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t mask;
    unsigned char *pool;
    int kind;
    unsigned char *classes; /* 0x110000 bytes */
} Encoder;

#define NO_RANK 0xFFFFFFFFu
#define C_L 1
#define C_N 2
#define C_S 4
#define C_U 8

static inline uint32_t lookup(const Encoder *e, const unsigned char *s, size_t n) {
    size_t i = (size_t)hash_bytes(s, n) & e->mask;
    for (;;) {
        const Slot *sl = &e->slots[i];
        if (sl->len == 0) return NO_RANK;
        if (sl->len == n && memcmp(e->pool + sl->off, s, n) == 0) return sl->rank;
        i = (i + 1) & e->mask;
    }
}

static void Encoder_dealloc(Encoder *e) {
    PyMem_Free(e->slots);
    PyMem_Free(e->pool);
    PyMem_Free(e->classes);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static int Encoder_init(Encoder *e, PyObject *args, PyObject *Py_UNUSED(kw)) {
    PyObject *ranks;
    int kind;
    Py_buffer classes;
    if (!PyArg_ParseTuple(args, "O!iy*", &PyDict_Type, &ranks, &kind, &classes)) return -1;
    if (classes.len != 0x110000 || kind < 0 || kind > 2) {
        PyBuffer_Release(&classes);
        PyErr_SetString(PyExc_ValueError, "classes must have 0x110000 bytes and kind be 0, 1 or 2");
        return -1;
    }
    e->classes = PyMem_Malloc(0x110000);
    if (e->classes == NULL) {
        PyBuffer_Release(&classes);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(e->classes, classes.buf, 0x110000);
    PyBuffer_Release(&classes);
    e->kind = kind;
    Py_ssize_t n = PyDict_Size(ranks), pos = 0, total = 0;
    PyObject *k, *v;
    while (PyDict_Next(ranks, &pos, &k, &v)) {
        if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) == 0 || !PyLong_Check(v)) {
            PyErr_SetString(PyExc_TypeError, "ranks must map non-empty bytes to int");
            return -1;
        }
        total += PyBytes_GET_SIZE(k);
    }
    size_t size = 16;
    while (size < (size_t)n * 2) size <<= 1;
    e->slots = PyMem_Calloc(size, sizeof(Slot));
    e->pool = PyMem_Malloc((size_t)total + 1);
    if (e->slots == NULL || e->pool == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    e->mask = size - 1;
    size_t off = 0;
    pos = 0;
    while (PyDict_Next(ranks, &pos, &k, &v)) {
        unsigned long r = PyLong_AsUnsignedLong(v);
        if (r == (unsigned long)-1 && PyErr_Occurred()) return -1;
        if (r >= NO_RANK) {
            PyErr_SetString(PyExc_ValueError, "rank too large");
            return -1;
        }
        const unsigned char *s = (const unsigned char *)PyBytes_AS_STRING(k);
        size_t len = (size_t)PyBytes_GET_SIZE(k);
        size_t i = (size_t)hash_bytes(s, len) & e->mask;
        while (e->slots[i].len != 0) i = (i + 1) & e->mask;
        memcpy(e->pool + off, s, len);
        e->slots[i].off = (uint32_t)off;
        e->slots[i].len = (uint32_t)len;
        e->slots[i].rank = (uint32_t)r;
        off += len;
    }
    return 0;
}

/* -- BPE of one piece ------------------------------------------------------------------------ */

typedef struct {
    size_t start;
    uint32_t rank;
} Part;

typedef struct {
    uint32_t *data;
    size_t len, cap;
} Ids;

static int emit(Ids *out, uint32_t rank) {
    if (out->len == out->cap) {
        size_t cap = out->cap ? out->cap * 2 : 1024;
        uint32_t *d = PyMem_Realloc(out->data, cap * sizeof(uint32_t));
        if (d == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        out->data = d;
        out->cap = cap;
    }
    out->data[out->len++] = rank;
    return 0;
}

static uint32_t part_rank(const Encoder *e, const unsigned char *s, const Part *parts, size_t np, size_t i) {
    if (i + 3 < np) return lookup(e, s + parts[i].start, parts[i + 3].start - parts[i].start);
    return NO_RANK;
}

static int bpe_piece(const Encoder *e, const unsigned char *s, size_t n, Ids *out, Part *parts) {
    uint32_t whole = lookup(e, s, n);
    if (whole != NO_RANK) return emit(out, whole);
    if (n == 1) {
        PyErr_SetString(PyExc_ValueError, "a byte has no rank");
        return -1;
    }
    size_t np = 0;
    uint32_t min_rank = NO_RANK;
    size_t min_i = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        uint32_t r = lookup(e, s + i, 2);
        if (r < min_rank) {
            min_rank = r;
            min_i = i;
        }
        parts[np].start = i;
        parts[np].rank = r;
        np++;
    }
    parts[np].start = n - 1;
    parts[np++].rank = NO_RANK;
    parts[np].start = n;
    parts[np++].rank = NO_RANK;
    while (min_rank != NO_RANK) {
        size_t i = min_i;
        if (i > 0) parts[i - 1].rank = part_rank(e, s, parts, np, i - 1);
        parts[i].rank = part_rank(e, s, parts, np, i);
        memmove(&parts[i + 1], &parts[i + 2], (np - i - 2) * sizeof(Part));
        np--;
        min_rank = NO_RANK;
        for (size_t j = 0; j + 1 < np; j++) {
            if (parts[j].rank < min_rank) {
                min_rank = parts[j].rank;
                min_i = j;
            }
        }
    }
    for (size_t j = 0; j + 1 < np; j++) {
        uint32_t r = lookup(e, s + parts[j].start, parts[j + 1].start - parts[j].start);
        if (r == NO_RANK) {
            PyErr_SetString(PyExc_ValueError, "a merged part has no rank");
            return -1;
        }
        if (emit(out, r) < 0) return -1;
    }
    return 0;
}

/* -- the pre-tokenizers ---------------------------------------------------------------------- */

typedef struct {
    int kind;
    void *data;
    Py_ssize_t len;
    const unsigned char *cls;
} Text;

static inline Py_UCS4 ch(const Text *t, Py_ssize_t i) { return PyUnicode_READ(t->kind, t->data, i); }
static inline int cls(const Text *t, Py_ssize_t i) {
    Py_UCS4 c = ch(t, i);
    return c < 0x110000 ? t->cls[c] : 0;
}
static inline int is_l(const Text *t, Py_ssize_t i) { return cls(t, i) & C_L; }
static inline int is_n(const Text *t, Py_ssize_t i) { return cls(t, i) & C_N; }
static inline int is_s(const Text *t, Py_ssize_t i) { return cls(t, i) & C_S; }
static inline int is_other(const Text *t, Py_ssize_t i) { return !(cls(t, i) & (C_L | C_N | C_S)); }
static inline int is_nl(const Text *t, Py_ssize_t i) {
    Py_UCS4 c = ch(t, i);
    return c == '\r' || c == '\n';
}

/* 's 't 're 've 'm 'll 'd at i (ASCII letters, case-insensitive when `fold`): the end, or 0 */
static Py_ssize_t contraction(const Text *t, Py_ssize_t i, int fold) {
    if (ch(t, i) != '\'' || i + 1 >= t->len) return 0;
    Py_UCS4 a = ch(t, i + 1), b = i + 2 < t->len ? ch(t, i + 2) : 0;
    if (fold) { /* Unicode simple case folding of these letters: ASCII, and the long s */
        if (a >= 'A' && a <= 'Z') a += 32;
        if (b >= 'A' && b <= 'Z') b += 32;
        if (a == 0x17F) a = 's';
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    return 0;
}

/* \s+(?!\S) then \s+, from i (a white space): the end of the match */
static Py_ssize_t spaces(const Text *t, Py_ssize_t i) {
    Py_ssize_t j = i;
    while (j < t->len && is_s(t, j)) j++;
    if (j < t->len && j - 1 > i) return j - 1; /* leave the last one to the next word */
    return j;
}

static Py_ssize_t next_gpt2(const Text *t, Py_ssize_t i) {
    Py_ssize_t j, n = t->len;
    if ((j = contraction(t, i, 0))) return j;
    j = i + (ch(t, i) == ' ' && i + 1 < n);
    if (is_l(t, j)) {
        while (j < n && is_l(t, j)) j++;
        return j;
    }
    if (is_n(t, j)) {
        while (j < n && is_n(t, j)) j++;
        return j;
    }
    if (is_other(t, j)) {
        while (j < n && is_other(t, j)) j++;
        return j;
    }
    if (is_s(t, i)) return spaces(t, i);
    return i + 1; /* not reached: every character is in one class */
}

static Py_ssize_t next_llama3(const Text *t, Py_ssize_t i, int max_digits) {
    Py_ssize_t j, n = t->len;
    if ((j = contraction(t, i, 1))) return j;
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    j = i;
    if (!is_l(t, j) && !is_n(t, j) && !is_nl(t, j) && j + 1 < n && is_l(t, j + 1)) j++;
    if (is_l(t, j)) {
        while (j < n && is_l(t, j)) j++;
        return j;
    }
    /* \p{N}{1,max} */
    if (is_n(t, i)) {
        j = i;
        while (j < n && j - i < max_digits && is_n(t, j)) j++;
        return j;
    }
    /* ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
    j = i + (ch(t, i) == ' ' && i + 1 < n);
    if (is_other(t, j)) {
        while (j < n && is_other(t, j)) j++;
        while (j < n && is_nl(t, j)) j++;
        return j;
    }
    /* \s*[\r\n]+: up to the last line break of the white space run */
    j = i;
    Py_ssize_t last = -1;
    while (j < n && is_s(t, j)) {
        if (is_nl(t, j)) last = j;
        j++;
    }
    if (last >= 0) return last + 1;
    return spaces(t, i);
}

/* the token ranks of `arg` into `out` (0), or -1 with an exception set */
static int encode_into(Encoder *e, PyObject *arg, Ids *out) {
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "text must be a str");
        return -1;
    }
    if (PyUnicode_READY(arg) < 0) return -1;
    Text t = {PyUnicode_KIND(arg), PyUnicode_DATA(arg), PyUnicode_GET_LENGTH(arg), e->classes};
    for (Py_ssize_t k = 0; k < t.len; k++) {
        if (cls(&t, k) & C_U) {
            PyErr_SetString(PyExc_ValueError, "a code point this Python's Unicode data does not assign");
            return -1;
        }
    }
    size_t cap = 256;
    unsigned char *buf = PyMem_Malloc(cap);
    Part *parts = PyMem_Malloc((cap + 2) * sizeof(Part));
    if (buf == NULL || parts == NULL) goto nomem;
    Py_ssize_t i = 0;
    while (i < t.len) {
        Py_ssize_t j = e->kind == 0 ? next_gpt2(&t, i) : next_llama3(&t, i, e->kind == 1 ? 3 : 1);
        /* the piece as UTF-8 */
        size_t need = (size_t)(j - i) * 4;
        if (need > cap) {
            while (cap < need) cap *= 2;
            PyMem_Free(buf);
            PyMem_Free(parts);
            buf = PyMem_Malloc(cap);
            parts = PyMem_Malloc((cap + 2) * sizeof(Part));
            if (buf == NULL || parts == NULL) goto nomem;
        }
        size_t m = 0;
        for (Py_ssize_t k = i; k < j; k++) {
            Py_UCS4 c = ch(&t, k);
            if (c < 0x80) {
                buf[m++] = (unsigned char)c;
            } else if (c < 0x800) {
                buf[m++] = (unsigned char)(0xC0 | (c >> 6));
                buf[m++] = (unsigned char)(0x80 | (c & 0x3F));
            } else if (c < 0x10000) {
                if (c >= 0xD800 && c <= 0xDFFF) {
                    PyErr_SetString(PyExc_ValueError, "a lone surrogate");
                    goto fail;
                }
                buf[m++] = (unsigned char)(0xE0 | (c >> 12));
                buf[m++] = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
                buf[m++] = (unsigned char)(0x80 | (c & 0x3F));
            } else {
                buf[m++] = (unsigned char)(0xF0 | (c >> 18));
                buf[m++] = (unsigned char)(0x80 | ((c >> 12) & 0x3F));
                buf[m++] = (unsigned char)(0x80 | ((c >> 6) & 0x3F));
                buf[m++] = (unsigned char)(0x80 | (c & 0x3F));
            }
        }
        if (bpe_piece(e, buf, m, out, parts) < 0) goto fail;
        i = j;
    }
    PyMem_Free(buf);
    PyMem_Free(parts);
    return 0;
nomem:
    PyErr_NoMemory();
fail:
    PyMem_Free(buf);
    PyMem_Free(parts);
    return -1;
}

static PyObject *Encoder_encode(Encoder *e, PyObject *arg) {
    Ids ids = {NULL, 0, 0};
    PyObject *out = NULL;
    if (encode_into(e, arg, &ids) == 0 && (out = PyList_New((Py_ssize_t)ids.len)) != NULL) {
        for (size_t i = 0; i < ids.len; i++) {
            PyObject *x = PyLong_FromUnsignedLong(ids.data[i]);
            if (x == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, (Py_ssize_t)i, x);
        }
    }
    PyMem_Free(ids.data);
    return out;
}

static PyObject *Encoder_encode_bytes(Encoder *e, PyObject *arg) {
    Ids ids = {NULL, 0, 0};
    PyObject *out = NULL;
    if (encode_into(e, arg, &ids) == 0)
        out = PyBytes_FromStringAndSize((const char *)ids.data, (Py_ssize_t)(ids.len * sizeof(uint32_t)));
    PyMem_Free(ids.data);
    return out;
}

static PyMethodDef Encoder_methods[] = {
    {"encode", (PyCFunction)Encoder_encode, METH_O, "Token ranks of a text without special tokens."},
    {"encode_bytes", (PyCFunction)Encoder_encode_bytes, METH_O, "encode()'s ranks as array('I') bytes."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gateway.analysis._native.Encoder",
    .tp_basicsize = sizeof(Encoder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Encoder_init,
    .tp_dealloc = (destructor)Encoder_dealloc,
    .tp_methods = Encoder_methods,
    .tp_doc = "Byte-level BPE with a hand-written pre-tokenizer (see the module's comment).",
};

static PyMethodDef methods[] = {
    {"cbor_block", cbor_block, METH_VARARGS, "Canonical CBOR of (parent, tuple(tokens[start:end]), extra)."},
    {"chain_hashes", chain_hashes, METH_VARARGS, "sha256_cbor block hashes of a range of blocks, chained."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&EncoderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&EncoderType);
    if (PyModule_AddObject(m, "Encoder", (PyObject *)&EncoderType) < 0) {
        Py_DECREF(&EncoderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
