/* kvtier.manager._native: the per-block loops of the scheduler thread and the tree they
 * walk, compiled.
 *
 * What is here (kvtier.manager.core.native has the pure-Python twin of each, and
 * tests/test_native.py holds the two to identical keys and identical manager states):
 *
 *   chain_keys    token list -> chained 128-bit tree keys (manager/keys.py's formula)
 *   DeviceNode,   the tree's nodes (twins of tree.DeviceNode / tree.Node): 80 / 104 bytes,
 *   Node          key as two 64-bit halves, block ids as int32, not tracked by the GC
 *   KeyMap        the tree's map key -> node (twin: a dict): open addressing, 24-byte slots,
 *                 presized, huge pages when big
 *   walk_hits     match's walk over cached device blocks that need no special handling
 *   release_walk  release's reference drops and device-LRU appends
 *   commit_walk   commit's new nodes and duplicates
 *   evict_drop    device-only eviction: a run of LRU victims leaves the list and the tree
 *   clear_walk    clearing the tree (reset, a lost worker)
 *   pool_free     a block pool's check-and-free
 *   dev_ids       the device block ids of a request's nodes
 *
 * Memory, per cached block of a device-only manager (bench/hotpath.py): 229 bytes of heap
 * with the pure-Python twins (96-byte slots node, its 48-byte int key, the dict's entry and
 * index), about 120 compiled (80-byte node, a KeyMap slot at load <= 3/4, the pool's ids).
 *
 * Hashing: xxh3-128 is not reimplemented here. The `xxhash` package (a dependency) ships its
 * C library inside its extension module, with the library's public entry points exported;
 * module init resolves XXH3_128bits_withSeed from that already-loaded module with dlsym and
 * checks it against the package's Python function on a spread of lengths and seeds. If the
 * symbol is missing or any check differs, the import fails and kvtier uses the pure-Python
 * path, so keys are the package's keys either way.
 *
 * A manager takes its map, node classes and loops from kvtier.manager.core.native when it is
 * built, so compiled nodes only ever meet compiled loops; the walks still hand anything
 * unexpected (a node of another class, a flagged node) back to Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if PY_VERSION_HEX < 0x030C0000
/* Before 3.12 the member type codes live in structmember.h under their old names. */
#include <structmember.h>
#define Py_T_OBJECT_EX T_OBJECT_EX
#endif
#include <dlfcn.h>
#include <sys/mman.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t low64;
    uint64_t high64;
} hash128;

/* The xxHash library's documented signature of XXH3_128bits_withSeed. */
typedef hash128 (*xxh3_128_with_seed_fn)(const void *data, size_t len, uint64_t seed);

static xxh3_128_with_seed_fn xxh3_128;

/* ------------------------------------------------------------------ keys */

/* One token id as int32 (returned as its uint32 bit pattern); -1 when it is not an exact int
 * within int32 (the caller then leaves the request to the Python path, which names the
 * offending token in its error). */
static inline int
token32(PyObject *o, uint32_t *out)
{
    if (!PyLong_CheckExact(o)) {
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000
    {
        Py_ssize_t size = Py_SIZE(o);
        if (size == 0) {
            *out = 0;
            return 0;
        }
        if (size == 1 || size == -1) {
            uint32_t d = (uint32_t)((PyLongObject *)o)->ob_digit[0];
            *out = size == 1 ? d : (uint32_t)0 - d;
            return 0;
        }
    }
#endif
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(o, &overflow);
    if (overflow || v < INT32_MIN || v > INT32_MAX) {
        PyErr_Clear();
        return -1;
    }
    *out = (uint32_t)(int32_t)v;
    return 0;
}

static inline void
store_le32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static inline uint64_t
load_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

static inline void
store_le64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

/* 128-bit ints to and from bytes. CPython 3.13 made this public API (PyLong_AsNativeBytes,
 * PyLong_FromUnsignedNativeBytes); before it, the only way without a shift and an or per key
 * (three int objects: 0.1 us a key on match's walk) is the private pair below, whose
 * signatures are the ones of exactly 3.11 and 3.12 (3.13 added a sixth argument to
 * _PyLong_AsByteArray). Any other version takes the public calls. */
#if PY_VERSION_HEX >= 0x030D0000
#define KEY_BYTES_FLAGS (Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER)
#elif PY_VERSION_HEX < 0x030B0000
#error "kvtier.manager._native needs CPython 3.11 or later"
#endif

static PyObject *
key_from_halves(uint64_t lo, uint64_t hi)
{
    unsigned char b[16];
    store_le64(b, lo);
    store_le64(b + 8, hi);
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(b, 16, KEY_BYTES_FLAGS);
#else
    return _PyLong_FromByteArray(b, 16, 1, 0);
#endif
}

/* A key (an exact int in [0, 2**128)) as its two 64-bit halves; -1 (no error set) otherwise. */
static int
key_to_halves(PyObject *key, uint64_t *lo, uint64_t *hi)
{
    unsigned char b[16];
    if (!PyLong_CheckExact(key)) {
        return -1;
    }
#if PY_VERSION_HEX >= 0x030D0000
    /* the bytes the value needs (> 16: too big); negative values are refused */
    Py_ssize_t need = PyLong_AsNativeBytes(key, b, 16,
                                           KEY_BYTES_FLAGS | Py_ASNATIVEBYTES_REJECT_NEGATIVE);
    if (need < 0 || need > 16) {
        PyErr_Clear();
        return -1;
    }
#else
    if (_PyLong_Sign(key) < 0) {
        return -1;
    }
    if (_PyLong_AsByteArray((PyLongObject *)key, b, 16, 1, 0) < 0) {
        PyErr_Clear();
        return -1;
    }
#endif
    *lo = load_le64(b);
    *hi = load_le64(b + 8);
    return 0;
}

PyDoc_STRVAR(chain_keys_doc,
"chain_keys(token_ids, block_size, parent, start_block, end_block) -> list[int] | None\n\n"
"Tree keys of blocks [start_block, end_block) without multimodal items, chained from\n"
"`parent`. None when the Python path must handle the input (not a list or tuple of exact\n"
"ints within int32, or a parent outside [0, 2**128)).");

static PyObject *
chain_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "chain_keys takes 5 arguments");
        return NULL;
    }
    PyObject *tokens = args[0];
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    Py_ssize_t end = PyLong_AsSsize_t(args[4]);
    if ((bs == -1 || start == -1 || end == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens)) {
        Py_RETURN_NONE;
    }
    uint64_t lo, hi;
    if (bs <= 0 || start < 0 || key_to_halves(args[2], &lo, &hi) < 0) {
        Py_RETURN_NONE;
    }
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    Py_ssize_t n_tokens = PySequence_Fast_GET_SIZE(tokens);
    if (end > n_tokens / bs) {
        end = n_tokens / bs;
    }
    if (end <= start) {
        return PyList_New(0);
    }
    /* Tokens before start_block are checked too: the Python path packs them all. */
    uint32_t scratch;
    for (Py_ssize_t i = 0; i < start * bs; i++) {
        if (token32(items[i], &scratch) < 0) {
            Py_RETURN_NONE;
        }
    }
    size_t step = (size_t)bs * 4;
    unsigned char stack_buf[1024];
    unsigned char *buf = step <= sizeof(stack_buf) ? stack_buf : PyMem_Malloc(step);
    if (buf == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *out = PyList_New(end - start);
    if (out == NULL) {
        goto fail;
    }
    for (Py_ssize_t b = start; b < end; b++) {
        PyObject **blk = items + b * bs;
        for (Py_ssize_t j = 0; j < bs; j++) {
            uint32_t v;
            if (token32(blk[j], &v) < 0) {
                Py_DECREF(out);
                if (buf != stack_buf) {
                    PyMem_Free(buf);
                }
                Py_RETURN_NONE;
            }
            store_le32(buf + 4 * j, v);
        }
        /* key = xxh3_128(block, seed=parent & (2**64 - 1)) ^ (parent >> 64) */
        hash128 h = xxh3_128(buf, step, lo);
        lo = h.low64 ^ hi;
        hi = h.high64;
        PyObject *key = key_from_halves(lo, hi);
        if (key == NULL) {
            Py_DECREF(out);
            goto fail;
        }
        PyList_SET_ITEM(out, b - start, key);
    }
    if (buf != stack_buf) {
        PyMem_Free(buf);
    }
    return out;
fail:
    if (buf != stack_buf) {
        PyMem_Free(buf);
    }
    return NULL;
}

PyDoc_STRVAR(xxh3_128_intdigest_doc,
"xxh3_128_intdigest(data: bytes, seed: int) -> int\n\n"
"The resolved xxh3-128 entry point (for the tests; keys use it through chain_keys).");

static PyObject *
py_xxh3_128_intdigest(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "xxh3_128_intdigest(data: bytes, seed: int)");
        return NULL;
    }
    uint64_t seed = PyLong_AsUnsignedLongLongMask(args[1]);
    if (seed == (uint64_t)-1 && PyErr_Occurred()) {
        return NULL;
    }
    hash128 h = xxh3_128(PyBytes_AS_STRING(args[0]), (size_t)PyBytes_GET_SIZE(args[0]), seed);
    return key_from_halves(h.low64, h.high64);
}

/* ------------------------------------------------------------------ nodes */

/* A key as its two 64-bit halves without a byte-array round trip (CPython 3.11's 30-bit
 * digits); -1 (no error set) when it is not an exact int in [0, 2**128). */
static inline int
key_halves(PyObject *key, uint64_t *lo, uint64_t *hi)
{
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    if (!PyLong_CheckExact(key)) {
        return -1;
    }
    Py_ssize_t n = Py_SIZE(key);
    if (n < 0 || n > 5) {
        return -1;
    }
    const digit *d = ((PyLongObject *)key)->ob_digit;
    if (n == 5 && d[4] >= 256) {  /* 4 * 30 + 8 = 128 bits */
        return -1;
    }
    unsigned __int128 v = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        v = (v << 30) | d[i];
    }
    *lo = (uint64_t)v;
    *hi = (uint64_t)(v >> 64);
    return 0;
#else
    return key_to_halves(key, lo, hi);
#endif
}

/* DeviceNode: what a device-only deployment stores per cached block, in 80 bytes (the
 * pure-Python twin, core.nodes.DeviceNode, is 96 bytes plus its 48-byte int key). The key is held
 * as two 64-bit halves (`has_key` 0: detached); block ids as int32 with -1 for None; `last`
 * as a double. The LRU links stay object references, so Python code and the IntrusiveLRU
 * descriptors handle them as before.
 *
 * Nodes are not tracked by the garbage collector (no GC header, and a full collection does
 * not walk millions of them: at 10M cached blocks that walk was a pause of its own). The
 * only cycles among nodes are the LRU rings, which core.nodes.IntrusiveLRU breaks when it is
 * freed; a node's other references (its storage key) lead to no container. */
typedef struct {
    PyObject_HEAD
    uint64_t klo, khi;
    PyObject *dprev, *dnext;
    double last;
    int32_t dev, ref, flags, hits;
    int32_t host;  /* Node only (always -1 in a DeviceNode) */
    uint8_t has_key;
} DNodeObject;

/* Node: a DeviceNode plus the host LRU links and the storage key (112 bytes). */
typedef struct {
    DNodeObject base;
    PyObject *hprev, *hnext, *skey;
} HNodeObject;

static PyTypeObject DNode_Type;
static PyTypeObject HNode_Type;

#define DN(o) ((DNodeObject *)(o))
#define HN(o) ((HNodeObject *)(o))
#define IS_NODE(o) (Py_IS_TYPE((o), &DNode_Type) || Py_IS_TYPE((o), &HNode_Type))
#define HAS_HOST_FIELDS(o) Py_IS_TYPE((o), &HNode_Type)
/* An LRU link: None and NULL (deleted from Python) both mean "not linked". */
#define LINKED(p) ((p) != NULL && (p) != Py_None)

static inline void
link_set(PyObject **field, PyObject *value)
{
    PyObject *old = *field;
    Py_INCREF(value);
    *field = value;
    Py_XDECREF(old);
}

static PyObject *
alloc_node(PyTypeObject *type, uint64_t lo, uint64_t hi, int has_key, int32_t dev,
           int32_t host, double last)
{
    DNodeObject *n = PyObject_New(DNodeObject, type);
    if (n == NULL) {
        return NULL;
    }
    n->klo = lo;
    n->khi = hi;
    n->has_key = (uint8_t)has_key;
    Py_INCREF(Py_None);
    n->dprev = Py_None;
    Py_INCREF(Py_None);
    n->dnext = Py_None;
    n->last = last;
    n->dev = dev;
    n->ref = 0;
    n->flags = 0;
    n->hits = 0;
    n->host = host;
    if (type == &HNode_Type) {
        HNodeObject *h = (HNodeObject *)n;
        Py_INCREF(Py_None);
        h->hprev = Py_None;
        Py_INCREF(Py_None);
        h->hnext = Py_None;
        Py_INCREF(Py_None);
        h->skey = Py_None;
    }
    return (PyObject *)n;
}

/* An int field value: None -> -1 where `nullable`, else an int in [lo_bound, INT32_MAX]. */
static int
int32_arg(PyObject *v, int nullable, long lo_bound, const char *name, int32_t *out)
{
    if (v == NULL) {
        PyErr_Format(PyExc_AttributeError, "cannot delete node.%s", name);
        return -1;
    }
    if (nullable && v == Py_None) {
        *out = -1;
        return 0;
    }
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "node.%s must be an int%s, not %.100s", name,
                     nullable ? " or None" : "", Py_TYPE(v)->tp_name);
        return -1;
    }
    int overflow = 0;
    long x = PyLong_AsLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || x < lo_bound || x > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "node.%s must be in [%ld, %ld], got %R", name, lo_bound,
                     (long)INT32_MAX, v);
        return -1;
    }
    *out = (int32_t)x;
    return 0;
}

static inline PyObject *
id_or_none(int32_t v)
{
    if (v < 0) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLong(v);
}

static PyObject *
node_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *key, *dev, *host, *last;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "node(key, dev, host, last) takes no keywords");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, type->tp_name, 4, 4, &key, &dev, &host, &last)) {
        return NULL;
    }
    uint64_t lo = 0, hi = 0;
    int has_key = key != Py_None;
    if (has_key && key_halves(key, &lo, &hi) < 0) {
        PyErr_Format(PyExc_ValueError, "node key must be an int in [0, 2**128) or None, got %R",
                     key);
        return NULL;
    }
    int32_t d, h = -1;
    if (int32_arg(dev, 1, 0, "dev", &d) < 0) {
        return NULL;
    }
    if (!PyType_IsSubtype(type, &HNode_Type)) {
        if (host != Py_None) {
            PyErr_SetString(PyExc_ValueError, "a device-only node cannot hold a host block");
            return NULL;
        }
    }
    else if (int32_arg(host, 1, 0, "host", &h) < 0) {
        return NULL;
    }
    double t = PyFloat_AsDouble(last);
    if (t == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (type != &DNode_Type && type != &HNode_Type) {  /* a Python subclass */
        PyObject *self = type->tp_alloc(type, 0);
        if (self == NULL) {
            return NULL;
        }
        DNodeObject *n = DN(self);
        n->klo = lo;
        n->khi = hi;
        n->has_key = (uint8_t)has_key;
        n->dev = d;
        n->host = h;
        n->last = t;
        link_set(&n->dprev, Py_None);
        link_set(&n->dnext, Py_None);
        if (PyType_IsSubtype(type, &HNode_Type)) {
            link_set(&HN(self)->hprev, Py_None);
            link_set(&HN(self)->hnext, Py_None);
            link_set(&HN(self)->skey, Py_None);
        }
        return self;
    }
    return alloc_node(type, lo, hi, has_key, d, h, t);
}

static int
dnode_clear(PyObject *self)
{
    Py_CLEAR(DN(self)->dprev);
    Py_CLEAR(DN(self)->dnext);
    return 0;
}

static int
hnode_clear(PyObject *self)
{
    Py_CLEAR(HN(self)->hprev);
    Py_CLEAR(HN(self)->hnext);
    Py_CLEAR(HN(self)->skey);
    return dnode_clear(self);
}

static void
node_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (PyType_IsSubtype(tp, &HNode_Type)) {
        hnode_clear(self);
    }
    else {
        dnode_clear(self);
    }
    tp->tp_free(self);
}

static PyObject *
node_repr(PyObject *self)
{
    DNodeObject *n = DN(self);
    char k[16], dev[16], host[16], buf[128];
    if (n->has_key) {
        snprintf(k, sizeof(k), "%08x", (unsigned)(n->klo & 0xFFFFFFFFu));
    }
    else {
        snprintf(k, sizeof(k), "detached");
    }
    if (n->dev < 0) {
        snprintf(dev, sizeof(dev), "None");
    }
    else {
        snprintf(dev, sizeof(dev), "%d", (int)n->dev);
    }
    if (n->host < 0) {
        snprintf(host, sizeof(host), "None");
    }
    else {
        snprintf(host, sizeof(host), "%d", (int)n->host);
    }
    snprintf(buf, sizeof(buf), "Node(%s, dev=%s, host=%s, ref=%d, flags=0x%x)", k, dev, host,
             (int)n->ref, (unsigned)n->flags);
    return PyUnicode_FromString(buf);
}

static PyObject *
get_key(PyObject *self, void *closure)
{
    DNodeObject *n = DN(self);
    if (!n->has_key) {
        Py_RETURN_NONE;
    }
    return key_from_halves(n->klo, n->khi);
}

static int
set_key(PyObject *self, PyObject *v, void *closure)
{
    DNodeObject *n = DN(self);
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete node.key");
        return -1;
    }
    if (v == Py_None) {
        n->has_key = 0;
        n->klo = n->khi = 0;
        return 0;
    }
    uint64_t lo, hi;
    if (key_halves(v, &lo, &hi) < 0) {
        PyErr_Format(PyExc_ValueError, "node.key must be an int in [0, 2**128) or None, got %R",
                     v);
        return -1;
    }
    n->klo = lo;
    n->khi = hi;
    n->has_key = 1;
    return 0;
}

static PyObject *
get_dev(PyObject *self, void *closure)
{
    return id_or_none(DN(self)->dev);
}

static int
set_dev(PyObject *self, PyObject *v, void *closure)
{
    return int32_arg(v, 1, 0, "dev", &DN(self)->dev);
}

static PyObject *
get_host(PyObject *self, void *closure)
{
    return id_or_none(DN(self)->host);
}

static int
set_host(PyObject *self, PyObject *v, void *closure)
{
    return int32_arg(v, 1, 0, "host", &DN(self)->host);
}

static PyObject *
get_int(PyObject *self, void *closure)
{
    return PyLong_FromLong(*(int32_t *)((char *)self + (Py_ssize_t)closure));
}

static int
set_int(PyObject *self, PyObject *v, void *closure)
{
    Py_ssize_t off = (Py_ssize_t)closure;
    const char *name = off == offsetof(DNodeObject, ref) ? "ref"
        : off == offsetof(DNodeObject, flags) ? "flags" : "hits";
    return int32_arg(v, 0, INT32_MIN, name, (int32_t *)((char *)self + off));
}

static PyObject *
get_last(PyObject *self, void *closure)
{
    return PyFloat_FromDouble(DN(self)->last);
}

static int
set_last(PyObject *self, PyObject *v, void *closure)
{
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete node.last");
        return -1;
    }
    double t = PyFloat_AsDouble(v);
    if (t == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    DN(self)->last = t;
    return 0;
}

static PyObject *
get_none(PyObject *self, void *closure)
{
    Py_RETURN_NONE;
}

#define INT_FIELD(name, doc) \
    {#name, get_int, set_int, doc, (void *)offsetof(DNodeObject, name)}

static PyGetSetDef dnode_getset[] = {
    {"key", get_key, set_key, "tree key (int in [0, 2**128)), None once detached", NULL},
    {"dev", get_dev, set_dev, "device block id or None", NULL},
    INT_FIELD(ref, "requests holding the node"),
    INT_FIELD(flags, "transfer and state flags (see kvtier.manager.core.nodes)"),
    INT_FIELD(hits, "times matched (saturates at 2**31 - 1 in the compiled walk)"),
    {"last", get_last, set_last, "monotonic time of the last match or commit", NULL},
    {"host", get_none, NULL, "always None: a device-only node", NULL},
    {"hprev", get_none, NULL, "always None: a device-only node", NULL},
    {"hnext", get_none, NULL, "always None: a device-only node", NULL},
    {"skey", get_none, NULL, "always None: a device-only node", NULL},
    {NULL},
};

static PyMemberDef dnode_members[] = {
    {"dprev", Py_T_OBJECT_EX, offsetof(DNodeObject, dprev), 0, "device LRU link"},
    {"dnext", Py_T_OBJECT_EX, offsetof(DNodeObject, dnext), 0, "device LRU link"},
    {NULL},
};

static PyGetSetDef hnode_getset[] = {
    {"host", get_host, set_host, "host block id or None", NULL},
    {NULL},
};

static PyMemberDef hnode_members[] = {
    {"hprev", Py_T_OBJECT_EX, offsetof(HNodeObject, hprev), 0, "host LRU link"},
    {"hnext", Py_T_OBJECT_EX, offsetof(HNodeObject, hnext), 0, "host LRU link"},
    {"skey", Py_T_OBJECT_EX, offsetof(HNodeObject, skey), 0, "storage key (bytes) or None"},
    {NULL},
};

static PyTypeObject DNode_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.manager._native.DeviceNode",
    .tp_doc = PyDoc_STR("DeviceNode(key, dev, host, last): a cached block-sized prefix of a "
                        "device-only deployment (kvtier.manager.core.nodes.DeviceNode, compiled)."),
    .tp_basicsize = sizeof(DNodeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = node_new,
    .tp_dealloc = node_dealloc,
    .tp_repr = node_repr,
    .tp_getset = dnode_getset,
    .tp_members = dnode_members,
};

static PyTypeObject HNode_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.manager._native.Node",
    .tp_doc = PyDoc_STR("Node(key, dev, host, last): a cached block-sized prefix with the host "
                        "tier's fields (kvtier.manager.core.nodes.Node, compiled)."),
    .tp_basicsize = sizeof(HNodeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = node_new,
    .tp_dealloc = node_dealloc,
    .tp_repr = node_repr,
    .tp_getset = hnode_getset,
    .tp_members = hnode_members,
};

/* ------------------------------------------------------------------ key map */

/* KeyMap: the tree's map, tree key -> node, as an open-addressing table (linear probing,
 * load <= 3/4, deletion by backward shift, so no tombstones). A slot is the key's two halves
 * and a reference to the value: 24 bytes, and no int object per key (a dict holds the key's
 * 48-byte int and a 24-byte entry plus its index). Values may be any object that does not
 * lead back to the map: like the nodes it holds, the map is not tracked by the garbage
 * collector (a full collection would otherwise read every slot). */
typedef struct {
    uint64_t lo, hi;
    PyObject *val;  /* NULL: empty */
} mslot;

typedef struct {
    PyObject_HEAD
    mslot *slots;
    uint64_t mask;  /* capacity - 1 (a power of two) */
    Py_ssize_t used;
} KeyMapObject;

static PyTypeObject KeyMap_Type;

static inline uint64_t
mhash(uint64_t lo, uint64_t hi)
{
    uint64_t x = lo ^ (hi * 0x9E3779B97F4A7C15ull);
    x ^= x >> 32;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 32;
    return x;
}

/* The slot holding (lo, hi), or the empty slot where it would go. */
static inline mslot *
km_find(KeyMapObject *m, uint64_t lo, uint64_t hi)
{
    uint64_t mask = m->mask, i = mhash(lo, hi) & mask;
    mslot *slots = m->slots;
    for (;;) {
        mslot *s = &slots[i];
        if (s->val == NULL || (s->lo == lo && s->hi == hi)) {
            return s;
        }
        i = (i + 1) & mask;
    }
}

/* Start loading the home slot of a key a few blocks ahead (a walk's lookups are independent,
 * so at scale their cache misses overlap instead of queueing). */
static inline void
km_prefetch(KeyMapObject *m, PyObject *key)
{
    uint64_t lo, hi;
    if (key_halves(key, &lo, &hi) == 0) {
        __builtin_prefetch(&m->slots[mhash(lo, hi) & m->mask]);
    }
}

#define PREFETCH_AHEAD 16

static inline PyObject *
km_get(KeyMapObject *m, uint64_t lo, uint64_t hi)
{
    return km_find(m, lo, hi)->val;  /* borrowed */
}

/* Ask for transparent huge pages over the 2 MiB-aligned inside of a big table: a lookup in
 * a table of hundreds of MiB is a cache miss either way, and with 4 KiB pages a TLB miss and
 * a page walk on top (measured on the chat workload over a fresh 10M-block manager: 0.70 -> 0.25 us/block
 * with the prefetching below). */
static void
advise_huge(void *p, size_t bytes)
{
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t start = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (end > start) {
        (void)madvise((void *)start, end - start, MADV_HUGEPAGE);  /* advice only */
    }
#endif
}

static int
km_resize(KeyMapObject *m, uint64_t cap)
{
    mslot *fresh = PyMem_Calloc((size_t)cap, sizeof(mslot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (cap * sizeof(mslot) >= ((size_t)8 << 20)) {
        advise_huge(fresh, (size_t)cap * sizeof(mslot));
    }
    mslot *old = m->slots;
    uint64_t old_cap = m->slots ? m->mask + 1 : 0;
    m->slots = fresh;
    m->mask = cap - 1;
    for (uint64_t i = 0; i < old_cap; i++) {
        if (old[i].val != NULL) {
            *km_find(m, old[i].lo, old[i].hi) = old[i];
        }
    }
    PyMem_Free(old);
    return 0;
}

static uint64_t
km_capacity_for(Py_ssize_t n)
{
    uint64_t cap = 8;
    while ((uint64_t)n * 4 > cap * 3) {
        cap <<= 1;
    }
    return cap;
}

/* Insert or replace; steals nothing (takes its own reference to `val`). */
static int
km_set(KeyMapObject *m, uint64_t lo, uint64_t hi, PyObject *val)
{
    if ((uint64_t)(m->used + 1) * 4 > (m->mask + 1) * 3
            && km_resize(m, (m->mask + 1) * 2) < 0) {
        return -1;
    }
    mslot *s = km_find(m, lo, hi);
    PyObject *old = s->val;
    Py_INCREF(val);
    s->val = val;
    if (old == NULL) {
        s->lo = lo;
        s->hi = hi;
        m->used++;
    }
    else {
        Py_DECREF(old);
    }
    return 0;
}

/* Remove (lo, hi); returns the reference the map held (NULL when absent, no error set). */
static PyObject *
km_pop(KeyMapObject *m, uint64_t lo, uint64_t hi)
{
    mslot *slots = m->slots;
    uint64_t mask = m->mask;
    mslot *s = km_find(m, lo, hi);
    PyObject *val = s->val;
    if (val == NULL) {
        return NULL;
    }
    uint64_t i = (uint64_t)(s - slots), j = i;
    for (;;) {  /* backward shift: pull later entries of the run into the hole */
        j = (j + 1) & mask;
        if (slots[j].val == NULL) {
            break;
        }
        uint64_t k = mhash(slots[j].lo, slots[j].hi) & mask;
        /* entry j stays unless its home k lies cyclically outside (i, j] */
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            slots[i] = slots[j];
            i = j;
        }
    }
    slots[i].val = NULL;
    m->used--;
    return val;
}

static PyObject *
keymap_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Py_ssize_t n = 0;
    static char *kwlist[] = {"capacity", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:KeyMap", kwlist, &n)) {
        return NULL;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "KeyMap capacity must be >= 0");
        return NULL;
    }
    KeyMapObject *m = (KeyMapObject *)type->tp_alloc(type, 0);
    if (m == NULL) {
        return NULL;
    }
    if (km_resize(m, km_capacity_for(n)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static int
keymap_clear_refs(PyObject *self)
{
    KeyMapObject *m = (KeyMapObject *)self;
    if (m->slots != NULL) {  /* the table keeps its size (it was sized for the tree) */
        for (uint64_t i = 0; i <= m->mask; i++) {
            Py_CLEAR(m->slots[i].val);
        }
    }
    m->used = 0;
    return 0;
}

static void
keymap_dealloc(PyObject *self)
{
    KeyMapObject *m = (KeyMapObject *)self;
    if (m->slots != NULL) {
        for (uint64_t i = 0; i <= m->mask; i++) {
            Py_XDECREF(m->slots[i].val);
        }
        PyMem_Free(m->slots);
        m->slots = NULL;
    }
    Py_TYPE(self)->tp_free(self);
}

static Py_ssize_t
keymap_len(PyObject *self)
{
    return ((KeyMapObject *)self)->used;
}

static PyObject *
keymap_subscript(PyObject *self, PyObject *key)
{
    uint64_t lo, hi;
    PyObject *v = key_halves(key, &lo, &hi) < 0 ? NULL : km_get((KeyMapObject *)self, lo, hi);
    if (v == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    Py_INCREF(v);
    return v;
}

static int
keymap_ass_subscript(PyObject *self, PyObject *key, PyObject *val)
{
    uint64_t lo, hi;
    if (key_halves(key, &lo, &hi) < 0) {
        if (val == NULL) {
            PyErr_SetObject(PyExc_KeyError, key);
        }
        else {
            PyErr_Format(PyExc_ValueError, "KeyMap keys are ints in [0, 2**128), got %R", key);
        }
        return -1;
    }
    if (val != NULL) {
        return km_set((KeyMapObject *)self, lo, hi, val);
    }
    PyObject *old = km_pop((KeyMapObject *)self, lo, hi);
    if (old == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    Py_DECREF(old);
    return 0;
}

static int
keymap_contains(PyObject *self, PyObject *key)
{
    uint64_t lo, hi;
    return key_halves(key, &lo, &hi) == 0 && km_get((KeyMapObject *)self, lo, hi) != NULL;
}

static PyObject *
keymap_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    uint64_t lo, hi;
    PyObject *v = key_halves(args[0], &lo, &hi) < 0 ? NULL
        : km_get((KeyMapObject *)self, lo, hi);
    if (v == NULL) {
        v = nargs == 2 ? args[1] : Py_None;
    }
    Py_INCREF(v);
    return v;
}

static PyObject *
keymap_pop(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    uint64_t lo, hi;
    PyObject *v = key_halves(args[0], &lo, &hi) < 0 ? NULL
        : km_pop((KeyMapObject *)self, lo, hi);  /* the map's reference, now ours */
    if (v != NULL) {
        return v;
    }
    if (nargs == 2) {
        Py_INCREF(args[1]);
        return args[1];
    }
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

/* 0: keys, 1: values, 2: items; a list (a snapshot: the map may change while it is used). */
static PyObject *
keymap_list(KeyMapObject *m, int what)
{
    PyObject *out = PyList_New(m->used);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t k = 0;
    for (uint64_t i = 0; i <= m->mask && k < m->used; i++) {
        mslot *s = &m->slots[i];
        if (s->val == NULL) {
            continue;
        }
        PyObject *item;
        if (what == 1) {
            Py_INCREF(s->val);
            item = s->val;
        }
        else {
            PyObject *key = key_from_halves(s->lo, s->hi);
            if (key == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            item = what == 0 ? key : PyTuple_Pack(2, key, s->val);
            if (what == 2) {
                Py_DECREF(key);
            }
            if (item == NULL) {
                Py_DECREF(out);
                return NULL;
            }
        }
        PyList_SET_ITEM(out, k++, item);
    }
    return out;
}

static PyObject *
keymap_keys(PyObject *self, PyObject *unused)
{
    return keymap_list((KeyMapObject *)self, 0);
}

static PyObject *
keymap_values(PyObject *self, PyObject *unused)
{
    return keymap_list((KeyMapObject *)self, 1);
}

static PyObject *
keymap_items(PyObject *self, PyObject *unused)
{
    return keymap_list((KeyMapObject *)self, 2);
}

static PyObject *
keymap_iter(PyObject *self)
{
    PyObject *keys = keymap_list((KeyMapObject *)self, 0);
    if (keys == NULL) {
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *
keymap_clear(PyObject *self, PyObject *unused)
{
    keymap_clear_refs(self);
    Py_RETURN_NONE;
}

static PyObject *
keymap_sizeof(PyObject *self, PyObject *unused)
{
    KeyMapObject *m = (KeyMapObject *)self;
    return PyLong_FromSize_t(sizeof(KeyMapObject) + (size_t)(m->mask + 1) * sizeof(mslot));
}

static PyMethodDef keymap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))keymap_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))keymap_pop, METH_FASTCALL, "pop(key[, default])"},
    {"keys", keymap_keys, METH_NOARGS, "the keys, as a list"},
    {"values", keymap_values, METH_NOARGS, "the values, as a list"},
    {"items", keymap_items, METH_NOARGS, "(key, value) pairs, as a list"},
    {"clear", keymap_clear, METH_NOARGS, "remove everything"},
    {"__sizeof__", keymap_sizeof, METH_NOARGS, "bytes of the object and its table"},
    {NULL},
};

static PyMappingMethods keymap_as_mapping = {
    .mp_length = keymap_len,
    .mp_subscript = keymap_subscript,
    .mp_ass_subscript = keymap_ass_subscript,
};

static PySequenceMethods keymap_as_sequence = {
    .sq_contains = keymap_contains,
};

static PyTypeObject KeyMap_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.manager._native.KeyMap",
    .tp_doc = PyDoc_STR("KeyMap(capacity=0): tree key (int in [0, 2**128)) -> node, an "
                        "open-addressing table presized for `capacity` entries."),
    .tp_basicsize = sizeof(KeyMapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = keymap_new,
    .tp_dealloc = keymap_dealloc,
    .tp_as_mapping = &keymap_as_mapping,
    .tp_as_sequence = &keymap_as_sequence,
    .tp_iter = keymap_iter,
    .tp_methods = keymap_methods,
};

/* ------------------------------------------------------------------ walks */

static inline int
is_keymap(PyObject *o)
{
    return Py_IS_TYPE(o, &KeyMap_Type);
}

PyDoc_STRVAR(walk_hits_doc,
"walk_hits(tree, keys, nodes, limit, now, hit_threshold, backups) -> (int, int)\n\n"
"Walk `keys[len(nodes):limit]` through `tree` (a KeyMap) while each node is a device hit\n"
"with no flags set: take it out of the device LRU, count a reference and a hit, stamp\n"
"`now`, append it to `nodes` (and to `backups` when it has no host copy and reached\n"
"`hit_threshold` hits, if that is non-zero). Returns (stop, unlinked): stop is 0 at\n"
"`limit`, 1 at a key not in the tree, 2 at a node the caller must handle itself (it is\n"
"not appended); unlinked counts the nodes taken out of the device LRU.");

static PyObject *
walk_hits(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7 || !is_keymap(args[0]) || !PyList_CheckExact(args[1])
            || !PyList_CheckExact(args[2]) || !PyList_CheckExact(args[6])) {
        PyErr_SetString(PyExc_TypeError,
                        "walk_hits(KeyMap, list, list, int, now, int, list) expected");
        return NULL;
    }
    KeyMapObject *tree = (KeyMapObject *)args[0];
    PyObject *keys = args[1], *nodes = args[2], *backups = args[6];
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    long threshold = PyLong_AsLong(args[5]);
    double now = PyFloat_AsDouble(args[4]);
    if ((limit == -1 || threshold == -1 || now == -1.0) && PyErr_Occurred()) {
        return NULL;
    }
    if (limit > PyList_GET_SIZE(keys)) {
        limit = PyList_GET_SIZE(keys);
    }
    long stop = 0;
    Py_ssize_t unlinked = 0;
    Py_ssize_t first = PyList_GET_SIZE(nodes);
    for (Py_ssize_t j = first; j < limit && j < first + PREFETCH_AHEAD; j++) {
        km_prefetch(tree, PyList_GET_ITEM(keys, j));
    }
    for (Py_ssize_t i = first; i < limit; i++) {
        uint64_t lo, hi;
        if (i + PREFETCH_AHEAD < limit) {
            km_prefetch(tree, PyList_GET_ITEM(keys, i + PREFETCH_AHEAD));
        }
        PyObject *node = key_halves(PyList_GET_ITEM(keys, i), &lo, &hi) < 0 ? NULL
            : km_get(tree, lo, hi);
        if (node == NULL) {
            stop = 1;
            break;
        }
        if (!IS_NODE(node)) {
            stop = 2;
            break;
        }
        DNodeObject *n = DN(node);
        if (n->dev < 0 || n->flags != 0 || n->ref == INT32_MAX) {
            stop = 2;
            break;
        }
        if (LINKED(n->dprev)) {  /* leave the device LRU */
            PyObject *prev = n->dprev, *nxt = n->dnext;
            /* the node's own references to its neighbours move to each other */
            PyObject *old = DN(prev)->dnext;  /* == node */
            DN(prev)->dnext = nxt;
            PyObject *old2 = DN(nxt)->dprev;  /* == node */
            DN(nxt)->dprev = prev;
            Py_INCREF(Py_None);
            n->dprev = Py_None;
            Py_INCREF(Py_None);
            n->dnext = Py_None;
            Py_DECREF(old);
            Py_DECREF(old2);
            unlinked++;
        }
        n->ref++;
        if (n->hits < INT32_MAX) {
            n->hits++;
        }
        n->last = now;
        if (PyList_Append(nodes, node) < 0) {
            return NULL;
        }
        if (threshold && n->hits >= threshold && n->host < 0
                && PyList_Append(backups, node) < 0) {
            return NULL;
        }
    }
    return Py_BuildValue("(ln)", stop, unlinked);
}

PyDoc_STRVAR(release_walk_doc,
"release_walk(nodes, head, now, busy) -> (list[int], int)\n\n"
"Drop one reference from each node of `nodes` (a list of nodes or None), last first; an\n"
"attached node reaching 0 references with no `busy` flag gets `last = now` and joins the\n"
"device LRU's tail (the list through sentinel `head`). Returns, last first, the indexes the\n"
"caller must finish itself: None entries (the request's own blocks) and detached nodes that\n"
"reached 0 references; and how many nodes joined the LRU (its size is the caller's).");

static PyObject *
release_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "release_walk(list, head, now, int) expected");
        return NULL;
    }
    PyObject *nodes = args[0], *head = args[1];
    double now = PyFloat_AsDouble(args[2]);
    long busy = PyLong_AsLong(args[3]);
    if ((busy == -1 || now == -1.0) && PyErr_Occurred()) {
        return NULL;
    }
    if (!IS_NODE(head) || !LINKED(DN(head)->dprev)) {
        PyErr_SetString(PyExc_TypeError, "head must be a linked node");
        return NULL;
    }
    /* Check every entry first, so an unexpected one changes nothing. */
    Py_ssize_t n = PyList_GET_SIZE(nodes);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        if (node != Py_None && (!IS_NODE(node) || DN(node)->ref == INT32_MIN)) {
            PyErr_Format(PyExc_ValueError, "release_walk: unexpected entry %R at %zd", node, i);
            return NULL;
        }
    }
    PyObject *rest = PyList_New(0);
    if (rest == NULL) {
        return NULL;
    }
    Py_ssize_t appended = 0;
    PyObject *tail = DN(head)->dprev;
    Py_INCREF(tail);  /* our reference while the chain grows */
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        if (i >= PREFETCH_AHEAD) {
            __builtin_prefetch(PyList_GET_ITEM(nodes, i - PREFETCH_AHEAD), 1);
        }
        if (node != Py_None) {
            DNodeObject *nd = DN(node);
            if (--nd->ref != 0) {
                continue;
            }
            if (nd->has_key) {
                if (nd->flags & busy) {
                    continue;
                }
                /* append to the device LRU's tail (links to head are closed after the loop) */
                nd->last = now;
                link_set(&nd->dprev, tail);
                link_set(&DN(tail)->dnext, node);
                Py_INCREF(node);
                Py_SETREF(tail, node);
                appended++;
                continue;
            }
        }
        PyObject *idx = PyLong_FromSsize_t(i);
        if (idx == NULL || PyList_Append(rest, idx) < 0) {
            Py_XDECREF(idx);
            link_set(&DN(tail)->dnext, head);
            link_set(&DN(head)->dprev, tail);
            Py_DECREF(tail);
            Py_DECREF(rest);
            return NULL;
        }
        Py_DECREF(idx);
    }
    link_set(&DN(tail)->dnext, head);
    link_set(&DN(head)->dprev, tail);
    Py_DECREF(tail);
    return Py_BuildValue("(Nn)", rest, appended);
}

PyDoc_STRVAR(commit_walk_doc,
"commit_walk(tree, keys, blocks, nodes, end, now, node_class, new_nodes) -> int\n\n"
"Join blocks len(nodes).. of a request to the tree, up to `end`: a key not in `tree` gets a\n"
"fresh `node_class` node (device block `blocks[i]`, one reference, `last = now`), put in the\n"
"tree and appended to `nodes` and `new_nodes`; a key whose node holds a device block is a\n"
"duplicate (None appended: the request keeps its block). Stops at a node holding no device\n"
"block (the caller handles it) and returns its index; `end` when done.");

static PyObject *
commit_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8 || !is_keymap(args[0]) || !PyList_CheckExact(args[1])
            || !PyList_CheckExact(args[2]) || !PyList_CheckExact(args[3])
            || !PyList_CheckExact(args[7])
            || (args[6] != (PyObject *)&DNode_Type && args[6] != (PyObject *)&HNode_Type)) {
        PyErr_SetString(PyExc_TypeError,
                        "commit_walk(KeyMap, list, list, list, int, now, DeviceNode | Node, "
                        "list) expected");
        return NULL;
    }
    KeyMapObject *tree = (KeyMapObject *)args[0];
    PyObject *keys = args[1], *blocks = args[2], *nodes = args[3], *new_nodes = args[7];
    PyTypeObject *cls = (PyTypeObject *)args[6];
    Py_ssize_t end = PyLong_AsSsize_t(args[4]);
    double now = PyFloat_AsDouble(args[5]);
    if ((end == -1 || now == -1.0) && PyErr_Occurred()) {
        return NULL;
    }
    if (end > PyList_GET_SIZE(keys) || end > PyList_GET_SIZE(blocks)) {
        PyErr_SetString(PyExc_ValueError, "commit_walk: end beyond keys or blocks");
        return NULL;
    }
    Py_ssize_t i = PyList_GET_SIZE(nodes);
    for (Py_ssize_t j = i; j < end && j < i + PREFETCH_AHEAD; j++) {
        km_prefetch(tree, PyList_GET_ITEM(keys, j));
    }
    for (; i < end; i++) {
        uint64_t lo, hi;
        if (i + PREFETCH_AHEAD < end) {
            km_prefetch(tree, PyList_GET_ITEM(keys, i + PREFETCH_AHEAD));
        }
        if (key_halves(PyList_GET_ITEM(keys, i), &lo, &hi) < 0) {
            break;  /* not a tree key: Python raises the error */
        }
        mslot *s = km_find(tree, lo, hi);
        PyObject *node = s->val;
        if (node != NULL) {
            if (!IS_NODE(node) || DN(node)->dev < 0) {
                break;
            }
            if (PyList_Append(nodes, Py_None) < 0) {
                return NULL;
            }
            continue;
        }
        PyObject *b = PyList_GET_ITEM(blocks, i);
        int overflow = 0;
        long dev = PyLong_CheckExact(b) ? PyLong_AsLongAndOverflow(b, &overflow) : -1;
        if (dev < 0 || dev > INT32_MAX || overflow) {
            PyErr_Clear();
            break;
        }
        node = alloc_node(cls, lo, hi, 1, (int32_t)dev, -1, now);
        if (node == NULL) {
            return NULL;
        }
        DN(node)->ref = 1;
        int err = km_set(tree, lo, hi, node);
        if (err == 0) {
            err = PyList_Append(nodes, node);
        }
        if (err == 0) {
            err = PyList_Append(new_nodes, node);
        }
        Py_DECREF(node);
        if (err < 0) {
            return NULL;
        }
    }
    return PyLong_FromSsize_t(i);
}

PyDoc_STRVAR(evict_drop_doc,
"evict_drop(tree, head, n) -> list[int]\n\n"
"Drop up to `n` nodes from the head (oldest end) of the device LRU through sentinel\n"
"`head`: each leaves the list and `tree` and is detached with no device block. Returns\n"
"their device block ids, oldest first (the caller frees them and fixes the counts).");

/* Two passes: the victims are collected first (the chain must be followed one node at a
 * time) and their map slots prefetched, so the second pass's deletions overlap their cache
 * misses (at 10M cached blocks every victim's slot is a miss). */
static PyObject *
evict_drop(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !is_keymap(args[0]) || !IS_NODE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "evict_drop(KeyMap, head, int) expected");
        return NULL;
    }
    KeyMapObject *tree = (KeyMapObject *)args[0];
    PyObject *head = args[1];
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0) {
        n = 0;
    }
    /* pass 1: the victims (borrowed: the ring holds them until pass 2 unlinks them) */
    PyObject *stack_victims[256];
    PyObject **victims = stack_victims;
    Py_ssize_t cap = 256, k = 0;
    PyObject *node = DN(head)->dnext;
    while (k < n && node != head && node != NULL) {
        if (!IS_NODE(node) || DN(node)->dev < 0 || !DN(node)->has_key) {
            if (k == 0) {  /* a caller looping until enough is free must stop */
                PyErr_Format(PyExc_RuntimeError, "evict_drop: %R is not an evictable "
                             "device node", node);
                return NULL;
            }
            break;  /* not what a device-only LRU holds: hand back what came before */
        }
        if (k == cap) {
            PyObject **grown = PyMem_Malloc((size_t)cap * 2 * sizeof(PyObject *));
            if (grown == NULL) {
                break;  /* drop what fits; the caller asks again */
            }
            memcpy(grown, victims, (size_t)cap * sizeof(PyObject *));
            if (victims != stack_victims) {
                PyMem_Free(victims);
            }
            victims = grown;
            cap *= 2;
        }
        __builtin_prefetch(&tree->slots[mhash(DN(node)->klo, DN(node)->khi) & tree->mask], 1);
        victims[k++] = node;
        node = DN(node)->dnext;
    }
    PyObject *freed = PyList_New(k);
    if (freed == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *dev = PyLong_FromLong(DN(victims[i])->dev);
        if (dev == NULL) {
            Py_CLEAR(freed);
            goto done;
        }
        PyList_SET_ITEM(freed, i, dev);
    }
    if (k > 0) {
        /* pass 2: head -> first survivor, then each victim leaves the ring and the map */
        PyObject *rest = DN(victims[k - 1])->dnext;
        Py_INCREF(head);
        Py_INCREF(rest);
        for (Py_ssize_t i = 0; i < k; i++) {
            DNodeObject *nd = DN(victims[i]);
            Py_INCREF(nd);
            PyObject *held = km_pop(tree, nd->klo, nd->khi);  /* the map's reference */
            nd->dev = -1;
            nd->has_key = 0;
            nd->klo = nd->khi = 0;
            link_set(&nd->dprev, Py_None);
            link_set(&nd->dnext, Py_None);
            Py_XDECREF(held);
            victims[i] = (PyObject *)nd;  /* our reference, dropped below */
        }
        link_set(&DN(head)->dnext, rest);
        link_set(&DN(rest)->dprev, head);
        Py_DECREF(rest);
        Py_DECREF(head);
        for (Py_ssize_t i = 0; i < k; i++) {
            Py_DECREF(victims[i]);
        }
    }
done:
    if (victims != stack_victims) {
        PyMem_Free(victims);
    }
    return freed;
}

PyDoc_STRVAR(clear_walk_doc,
"clear_walk(nodes, dev_free, host_free, in_flight) -> (int, int, int, list)\n\n"
"Detach every node of `nodes` (the tree being cleared, out of both LRU lists already)\n"
"that has no `in_flight` flag: its host block is marked in `host_free` (a bytearray by\n"
"block id) and dropped; its device block too unless requests hold the node (then it stays,\n"
"the requests' own); flags and key cleared. Returns (device blocks marked, host blocks\n"
"marked, nodes left holding a device block for requests, the nodes with a transfer in\n"
"flight, untouched).");

static PyObject *
clear_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_CheckExact(args[0]) || !PyByteArray_CheckExact(args[1])
            || !PyByteArray_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "clear_walk(list, bytearray, bytearray, int) expected");
        return NULL;
    }
    PyObject *nodes = args[0];
    unsigned char *dmark = (unsigned char *)PyByteArray_AS_STRING(args[1]);
    unsigned char *hmark = (unsigned char *)PyByteArray_AS_STRING(args[2]);
    Py_ssize_t dcap = PyByteArray_GET_SIZE(args[1]), hcap = PyByteArray_GET_SIZE(args[2]);
    long in_flight = PyLong_AsLong(args[3]);
    if (in_flight == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(nodes);
    /* Check first, so an unexpected entry changes nothing. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(nodes, i);
        if (!IS_NODE(o) || DN(o)->dev >= dcap || DN(o)->host >= hcap) {
            PyErr_Format(PyExc_ValueError, "clear_walk: unexpected entry %R at %zd", o, i);
            return NULL;
        }
    }
    PyObject *busy = PyList_New(0);
    if (busy == NULL) {
        return NULL;
    }
    Py_ssize_t dev_freed = 0, host_freed = 0, detached = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            __builtin_prefetch(PyList_GET_ITEM(nodes, i + PREFETCH_AHEAD), 1);
        }
        DNodeObject *nd = DN(PyList_GET_ITEM(nodes, i));
        if (nd->flags & in_flight) {
            if (PyList_Append(busy, (PyObject *)nd) < 0) {
                Py_DECREF(busy);
                return NULL;
            }
            continue;
        }
        if (nd->host >= 0) {
            hmark[nd->host] = 1;
            nd->host = -1;
            host_freed++;
        }
        if (nd->dev >= 0) {
            if (nd->ref > 0) {
                detached++;
            }
            else {
                dmark[nd->dev] = 1;
                nd->dev = -1;
                dev_freed++;
            }
        }
        nd->flags = 0;
        nd->has_key = 0;
        nd->klo = nd->khi = 0;
    }
    return Py_BuildValue("(nnnN)", dev_freed, host_freed, detached, busy);
}

PyDoc_STRVAR(dev_ids_doc,
"dev_ids(nodes) -> list[int | None]\n\n"
"The device block id (or None) of each node of `nodes`.");

static PyObject *
dev_ids(PyObject *self, PyObject *nodes)
{
    if (!PyList_CheckExact(nodes)) {
        PyErr_SetString(PyExc_TypeError, "dev_ids(list) expected");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(nodes);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(nodes, i);
        PyObject *v = IS_NODE(o) ? id_or_none(DN(o)->dev) : PyObject_GetAttrString(o, "dev");
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

PyDoc_STRVAR(pool_free_doc,
"pool_free(used, free, ids) -> bool\n\n"
"Give `ids` (a list) back to a block pool: `used` its bytearray (1 per id out of the pool),\n"
"`free` its free list. Only when every id is an exact int in range, out of the pool and\n"
"given once: marks them free, appends them to `free` and returns True. Otherwise changes\n"
"nothing and returns False (kvtier.manager.core.block_pool then raises the precise error).");

static PyObject *
pool_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyByteArray_CheckExact(args[0]) || !PyList_CheckExact(args[1])
            || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "pool_free(bytearray, list, list) expected");
        return NULL;
    }
    PyObject *ids = args[2];
    unsigned char *used = (unsigned char *)PyByteArray_AS_STRING(args[0]);
    Py_ssize_t cap = PyByteArray_GET_SIZE(args[0]), n = PyList_GET_SIZE(ids), i;
    for (i = 0; i < n; i++) {  /* check, marking each id seen (2) to catch repeats */
        PyObject *o = PyList_GET_ITEM(ids, i);
        int overflow = 0;
        long v = PyLong_CheckExact(o) ? PyLong_AsLongAndOverflow(o, &overflow) : -1;
        if (overflow || v < 0 || v >= cap || used[v] != 1) {
            PyErr_Clear();
            break;
        }
        used[v] = 2;
    }
    int ok = i == n;
    for (Py_ssize_t j = 0; j < i; j++) {
        used[PyLong_AsLong(PyList_GET_ITEM(ids, j))] = ok ? 0 : 1;
    }
    if (!ok) {
        Py_RETURN_FALSE;
    }
    PyObject *free_list = args[1];
    Py_ssize_t at = PyList_GET_SIZE(free_list);
    if (PyList_SetSlice(free_list, at, at, ids) < 0) {
        for (Py_ssize_t j = 0; j < n; j++) {  /* back out: nothing changed */
            used[PyLong_AsLong(PyList_GET_ITEM(ids, j))] = 1;
        }
        return NULL;
    }
    Py_RETURN_TRUE;
}

/* ------------------------------------------------------------------ module */

/* Resolve XXH3_128bits_withSeed from the loaded xxhash extension and check it against the
 * package's own xxh3_128_intdigest. 0 on success; -1 with ImportError set otherwise. */
static int
resolve_xxh3(void)
{
    PyObject *ext = PyImport_ImportModule("xxhash._xxhash");
    if (ext == NULL) {
        return -1;
    }
    PyObject *reference = PyObject_GetAttrString(ext, "xxh3_128_intdigest");
    PyObject *path = PyModule_GetFilenameObject(ext);
    Py_DECREF(ext);
    if (reference == NULL || path == NULL) {
        Py_XDECREF(reference);
        Py_XDECREF(path);
        return -1;
    }
    int rc = -1;
    const char *cpath = PyUnicode_AsUTF8(path);
    void *handle = cpath ? dlopen(cpath, RTLD_LAZY | RTLD_NOLOAD) : NULL;
    void *sym = handle ? dlsym(handle, "XXH3_128bits_withSeed") : NULL;
    if (handle != NULL) {
        dlclose(handle);  /* drops only the reference RTLD_NOLOAD took */
    }
    if (sym == NULL) {
        PyErr_Format(PyExc_ImportError,
                     "kvtier.manager._native: XXH3_128bits_withSeed not exported by %U", path);
        goto done;
    }
    xxh3_128 = (xxh3_128_with_seed_fn)sym;
    /* lengths across every xxh3 size class, seeds with high bits set */
    unsigned char data[1100];
    for (size_t i = 0; i < sizeof(data); i++) {
        data[i] = (unsigned char)(i * 131 + (i >> 3) * 7 + 1);
    }
    static const size_t lengths[] = {0, 1, 3, 4, 8, 9, 16, 17, 64, 128, 129, 200, 240, 241,
                                     256, 1024, 1100};
    static const uint64_t seeds[] = {0, 1, 0x9E3779B97F4A7C15ull, 0xFFFFFFFFFFFFFFFFull};
    for (size_t li = 0; li < sizeof(lengths) / sizeof(lengths[0]); li++) {
        for (size_t si = 0; si < sizeof(seeds) / sizeof(seeds[0]); si++) {
            hash128 h = xxh3_128(data, lengths[li], seeds[si]);
            PyObject *mine = key_from_halves(h.low64, h.high64);
            PyObject *bytes = PyBytes_FromStringAndSize((const char *)data,
                                                        (Py_ssize_t)lengths[li]);
            PyObject *seed = PyLong_FromUnsignedLongLong(seeds[si]);
            PyObject *theirs = (bytes && seed)
                ? PyObject_CallFunctionObjArgs(reference, bytes, seed, NULL) : NULL;
            int eq = (mine && theirs) ? PyObject_RichCompareBool(mine, theirs, Py_EQ) : -1;
            Py_XDECREF(mine);
            Py_XDECREF(bytes);
            Py_XDECREF(seed);
            Py_XDECREF(theirs);
            if (eq < 0) {
                goto done;
            }
            if (!eq) {
                PyErr_Format(PyExc_ImportError,
                             "kvtier.manager._native: XXH3_128bits_withSeed of %U differs "
                             "from xxhash.xxh3_128_intdigest (length %zu)", path, lengths[li]);
                goto done;
            }
        }
    }
    rc = 0;
done:
    if (rc < 0) {
        xxh3_128 = NULL;
    }
    Py_DECREF(reference);
    Py_DECREF(path);
    return rc;
}

PyDoc_STRVAR(keyed_hits_doc,
"keyed_hits(tree, hashes, busy) -> int\n\n"
"How many leading engine block hashes (bytes of at least 16) have a node in the KeyMap\n"
"`tree` that holds a host block and no `busy` flag: the key of a hash is its first 16\n"
"bytes, little-endian (kvtier.manager.keyed.engine_key). Stops at the first miss, at a\n"
"hash that is not bytes or is shorter than 16 bytes (those are keyed by a digest).");

static PyObject *
keyed_hits(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyObject_TypeCheck(args[0], &KeyMap_Type)) {
        PyErr_SetString(PyExc_TypeError, "keyed_hits(tree: KeyMap, hashes, busy: int)");
        return NULL;
    }
    KeyMapObject *m = (KeyMapObject *)args[0];
    long busy = PyLong_AsLong(args[2]);
    if (busy == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "hashes must be a sequence of bytes");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (i = 0; i < n; i++) {
        PyObject *h = items[i];
        if (!PyBytes_CheckExact(h) || PyBytes_GET_SIZE(h) < 16) {
            break;
        }
        const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(h);
        uint64_t lo = 0, hi = 0;
        for (int j = 7; j >= 0; j--) {  /* int.from_bytes(h[:16], "little") in two halves */
            lo = (lo << 8) | b[j];
            hi = (hi << 8) | b[8 + j];
        }
        PyObject *v = km_get(m, lo, hi);
        if (v == NULL) {
            break;
        }
        DNodeObject *nd = DN(v);
        if (nd->host < 0 || (nd->flags & busy)) {
            break;
        }
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL, chain_keys_doc},
    {"xxh3_128_intdigest", (PyCFunction)(void (*)(void))py_xxh3_128_intdigest, METH_FASTCALL,
     xxh3_128_intdigest_doc},
    {"walk_hits", (PyCFunction)(void (*)(void))walk_hits, METH_FASTCALL, walk_hits_doc},
    {"release_walk", (PyCFunction)(void (*)(void))release_walk, METH_FASTCALL,
     release_walk_doc},
    {"commit_walk", (PyCFunction)(void (*)(void))commit_walk, METH_FASTCALL, commit_walk_doc},
    {"evict_drop", (PyCFunction)(void (*)(void))evict_drop, METH_FASTCALL, evict_drop_doc},
    {"pool_free", (PyCFunction)(void (*)(void))pool_free, METH_FASTCALL, pool_free_doc},
    {"dev_ids", dev_ids, METH_O, dev_ids_doc},
    {"clear_walk", (PyCFunction)(void (*)(void))clear_walk, METH_FASTCALL, clear_walk_doc},
    {"keyed_hits", (PyCFunction)(void (*)(void))keyed_hits, METH_FASTCALL, keyed_hits_doc},
    {NULL, NULL, 0, NULL},
};

/* Multi-phase initialisation (PEP 489): the module object is created by the import system
 * and filled in here.
 *
 * The three types stay static types, deliberately: every per-block loop recognises a node by
 * comparing its type with &DNode_Type / &HNode_Type, a constant address; heap types would
 * turn that into a module-state lookup per call (and a per-module type per block). The price
 * is that the module cannot be loaded into several interpreters at once, which the slots
 * below declare (the import then fails cleanly in a subinterpreter), and the module holds no
 * per-module state besides them: the xxh3 entry point it resolves is the process's one. */
static int
native_exec(PyObject *mod)
{
    if (resolve_xxh3() < 0) {
        return -1;
    }
    HNode_Type.tp_base = &DNode_Type;
    if (PyType_Ready(&DNode_Type) < 0 || PyType_Ready(&HNode_Type) < 0
            || PyType_Ready(&KeyMap_Type) < 0) {
        return -1;
    }
    if (PyModule_AddType(mod, &DNode_Type) < 0 || PyModule_AddType(mod, &HNode_Type) < 0
            || PyModule_AddType(mod, &KeyMap_Type) < 0) {
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, (void *)native_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    /* the loops rely on the GIL: nodes and the map are not locked (a free-threaded build
     * re-enables the GIL when it imports this module) */
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier.manager._native",
    .m_doc = "The scheduler thread's per-block loops, compiled (see kvtier.manager.core.native).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = module_slots,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&module);
}
