/* kvtier.manager._native: the per-block loops of the scheduler thread, compiled.
 *
 * What is here, and nothing else (kvtier.manager.native has the pure-Python twin of each, and
 * tests/test_native.py holds the two to identical keys and identical manager states):
 *
 *   chain_keys   token list -> chained 128-bit tree keys (manager/keys.py's formula)
 *   walk_hits    match's walk over cached device blocks that need no special handling
 *   release_walk release's reference drops and device-LRU appends
 *
 * Hashing: xxh3-128 is not reimplemented here. The `xxhash` package (a dependency) ships its
 * C library inside its extension module, with the library's public entry points exported;
 * module init resolves XXH3_128bits_withSeed from that already-loaded module with dlsym and
 * checks it against the package's Python function on a spread of lengths and seeds. If the
 * symbol is missing or any check differs, the import fails and kvtier uses the pure-Python
 * path, so keys are the package's keys either way.
 *
 * Nodes (kvtier.manager.tree.DeviceNode / Node) stay Python objects with __slots__; `bind`
 * reads their slot offsets from the member descriptors, and the walks read and write those
 * slots directly. Any node that is not plainly one of the two bound classes, or any field
 * that does not hold what the fast path expects, is handed back to Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <dlfcn.h>
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

static PyObject *
key_from_halves(uint64_t lo, uint64_t hi)
{
    unsigned char b[16];
    store_le64(b, lo);
    store_le64(b + 8, hi);
    return _PyLong_FromByteArray(b, 16, 1, 0);
}

/* A key (an exact int in [0, 2**128)) as its two 64-bit halves; -1 (no error set) otherwise. */
static int
key_to_halves(PyObject *key, uint64_t *lo, uint64_t *hi)
{
    unsigned char b[16];
    if (!PyLong_CheckExact(key) || _PyLong_Sign(key) < 0) {
        return -1;
    }
    if (_PyLong_AsByteArray((PyLongObject *)key, b, 16, 1, 0) < 0) {
        PyErr_Clear();
        return -1;
    }
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

static PyTypeObject *device_node_type;  /* tree.DeviceNode: `host` is a class constant None */
static PyTypeObject *node_type;         /* tree.Node: `host` is a slot */
static Py_ssize_t off_key, off_dev, off_ref, off_flags, off_hits, off_last, off_dprev,
    off_dnext, off_host;
static int bound;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

static inline void
slot_set(PyObject *obj, Py_ssize_t off, PyObject *value)
{
    PyObject *old = SLOT(obj, off);
    Py_INCREF(value);
    SLOT(obj, off) = value;
    Py_XDECREF(old);
}

/* Whether `o` is a node of a bound class whose fields the walks touch are all set. */
static inline int
plain_node(PyObject *o)
{
    PyTypeObject *t = Py_TYPE(o);
    if (t != device_node_type && t != node_type) {
        return 0;
    }
    return SLOT(o, off_key) && SLOT(o, off_dev) && SLOT(o, off_ref) && SLOT(o, off_flags)
        && SLOT(o, off_hits) && SLOT(o, off_last) && SLOT(o, off_dprev) && SLOT(o, off_dnext)
        && (t == device_node_type || SLOT(o, off_host));
}

/* An int field's value as a C long: 0, or -1 when it is not an exact int in
 * (LONG_MIN, LONG_MAX) (no error set). */
static inline int
int_field(PyObject *o, long *out)
{
    if (!PyLong_CheckExact(o)) {
        return -1;
    }
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(o, &overflow);
    if (overflow || v == LONG_MIN || v == LONG_MAX) {
        PyErr_Clear();
        return -1;
    }
    *out = v;
    return 0;
}

static int
slot_offset(PyTypeObject *type, const char *name, Py_ssize_t *off)
{
    PyObject *d = PyObject_GetAttrString((PyObject *)type, name);
    if (d == NULL) {
        return -1;
    }
    int ok = Py_IS_TYPE(d, &PyMemberDescr_Type)
        && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
    if (ok) {
        *off = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    Py_DECREF(d);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not an object slot", type->tp_name, name);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(bind_doc,
"bind(DeviceNode, Node) -> None\n\n"
"Learn the slot layout of the tree's two node classes (called once, by\n"
"kvtier.manager.native). Node must subclass DeviceNode; `host` must be a slot of Node.");

static PyObject *
bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyType_Check(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "bind(DeviceNode, Node)");
        return NULL;
    }
    PyTypeObject *dn = (PyTypeObject *)args[0], *n = (PyTypeObject *)args[1];
    if (!PyType_IsSubtype(n, dn)) {
        PyErr_SetString(PyExc_TypeError, "Node must subclass DeviceNode");
        return NULL;
    }
    static const char *names[] = {"key", "dev", "ref", "flags", "hits", "last", "dprev",
                                  "dnext"};
    Py_ssize_t *offs[] = {&off_key, &off_dev, &off_ref, &off_flags, &off_hits, &off_last,
                          &off_dprev, &off_dnext};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        Py_ssize_t a, b;
        if (slot_offset(dn, names[i], &a) < 0 || slot_offset(n, names[i], &b) < 0) {
            return NULL;
        }
        if (a != b) {
            PyErr_Format(PyExc_TypeError, "slot %s differs between the node classes",
                         names[i]);
            return NULL;
        }
        *offs[i] = a;
    }
    if (slot_offset(n, "host", &off_host) < 0) {
        return NULL;
    }
    Py_INCREF(dn);
    Py_INCREF(n);
    Py_XSETREF(device_node_type, dn);
    Py_XSETREF(node_type, n);
    bound = 1;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(walk_hits_doc,
"walk_hits(tree, keys, nodes, limit, now, hit_threshold, backups) -> (int, int)\n\n"
"Walk `keys[len(nodes):limit]` through `tree` (a dict key -> node) while each node is a\n"
"device hit with no flags set: take it out of the device LRU, count a reference and a hit,\n"
"stamp `now`, append it to `nodes` (and to `backups` when it has no host copy and reached\n"
"`hit_threshold` hits, if that is non-zero). Returns (stop, unlinked): stop is 0 at\n"
"`limit`, 1 at a key not in the tree, 2 at a node the caller must handle itself (it is\n"
"not appended); unlinked counts the nodes taken out of the device LRU.");

static PyObject *
walk_hits(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7 || !PyDict_CheckExact(args[0]) || !PyList_CheckExact(args[1])
            || !PyList_CheckExact(args[2]) || !PyList_CheckExact(args[6])) {
        PyErr_SetString(PyExc_TypeError,
                        "walk_hits(dict, list, list, int, now, int, list) expected");
        return NULL;
    }
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "bind() was not called");
        return NULL;
    }
    PyObject *tree = args[0], *keys = args[1], *nodes = args[2], *now = args[4],
             *backups = args[6];
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    long threshold = PyLong_AsLong(args[5]);
    if ((limit == -1 || threshold == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (limit > PyList_GET_SIZE(keys)) {
        limit = PyList_GET_SIZE(keys);
    }
    long stop = 0;
    Py_ssize_t unlinked = 0;
    for (Py_ssize_t i = PyList_GET_SIZE(nodes); i < limit; i++) {
        PyObject *node = PyDict_GetItemWithError(tree, PyList_GET_ITEM(keys, i));
        if (node == NULL) {
            if (PyErr_Occurred()) {
                return NULL;
            }
            stop = 1;
            break;
        }
        long flags, ref, hits;
        if (!plain_node(node) || SLOT(node, off_dev) == Py_None
                || int_field(SLOT(node, off_flags), &flags) < 0 || flags != 0
                || int_field(SLOT(node, off_ref), &ref) < 0
                || int_field(SLOT(node, off_hits), &hits) < 0) {
            stop = 2;
            break;
        }
        PyObject *new_ref = PyLong_FromLong(ref + 1);
        PyObject *new_hits = PyLong_FromLong(hits + 1);
        if (new_ref == NULL || new_hits == NULL) {
            Py_XDECREF(new_ref);
            Py_XDECREF(new_hits);
            return NULL;
        }
        Py_INCREF(node);  /* held across the slot writes and the appends */
        PyObject *prev = SLOT(node, off_dprev);
        if (prev != Py_None) {  /* leave the device LRU */
            PyObject *nxt = SLOT(node, off_dnext);
            Py_INCREF(prev);
            Py_INCREF(nxt);
            slot_set(prev, off_dnext, nxt);
            slot_set(nxt, off_dprev, prev);
            slot_set(node, off_dprev, Py_None);
            slot_set(node, off_dnext, Py_None);
            Py_DECREF(prev);
            Py_DECREF(nxt);
            unlinked++;
        }
        Py_SETREF(SLOT(node, off_ref), new_ref);
        Py_SETREF(SLOT(node, off_hits), new_hits);
        slot_set(node, off_last, now);
        int err = PyList_Append(nodes, node);
        if (err == 0 && threshold && hits + 1 >= threshold
                && (Py_TYPE(node) == device_node_type || SLOT(node, off_host) == Py_None)) {
            err = PyList_Append(backups, node);
        }
        Py_DECREF(node);
        if (err < 0) {
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
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "bind() was not called");
        return NULL;
    }
    PyObject *nodes = args[0], *head = args[1], *now = args[2];
    long busy = PyLong_AsLong(args[3]);
    if (busy == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!plain_node(head)) {
        PyErr_SetString(PyExc_TypeError, "head must be a node");
        return NULL;
    }
    /* Check every entry first, so an unexpected one changes nothing. */
    Py_ssize_t n = PyList_GET_SIZE(nodes);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        long v;
        if (node != Py_None && (!plain_node(node) || int_field(SLOT(node, off_ref), &v) < 0
                                || int_field(SLOT(node, off_flags), &v) < 0)) {
            PyErr_Format(PyExc_ValueError, "release_walk: unexpected entry %R at %zd", node, i);
            return NULL;
        }
    }
    PyObject *rest = PyList_New(0);
    if (rest == NULL) {
        return NULL;
    }
    Py_ssize_t appended = 0;
    PyObject *tail = SLOT(head, off_dprev);
    Py_INCREF(tail);
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        if (node == Py_None) {
            goto later;
        }
        long ref, flags;
        int_field(SLOT(node, off_ref), &ref);  /* checked above */
        PyObject *new_ref = PyLong_FromLong(--ref);
        if (new_ref == NULL) {
            goto fail;
        }
        Py_SETREF(SLOT(node, off_ref), new_ref);
        if (ref != 0) {
            continue;
        }
        if (SLOT(node, off_key) == Py_None) {  /* detached: the caller frees its block */
            goto later;
        }
        int_field(SLOT(node, off_flags), &flags);
        if (flags & busy) {
            continue;
        }
        /* append to the device LRU's tail (links to head are closed after the loop) */
        slot_set(node, off_last, now);
        slot_set(node, off_dprev, tail);
        slot_set(tail, off_dnext, node);
        Py_INCREF(node);
        Py_SETREF(tail, node);
        appended++;
        continue;
later:
        {
            PyObject *idx = PyLong_FromSsize_t(i);
            if (idx == NULL || PyList_Append(rest, idx) < 0) {
                Py_XDECREF(idx);
                goto fail;
            }
            Py_DECREF(idx);
        }
    }
    slot_set(tail, off_dnext, head);
    slot_set(head, off_dprev, tail);
    Py_DECREF(tail);
    return Py_BuildValue("(Nn)", rest, appended);
fail:
    slot_set(tail, off_dnext, head);
    slot_set(head, off_dprev, tail);
    Py_DECREF(tail);
    Py_DECREF(rest);
    return NULL;
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

static PyMethodDef methods[] = {
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL, chain_keys_doc},
    {"xxh3_128_intdigest", (PyCFunction)(void (*)(void))py_xxh3_128_intdigest, METH_FASTCALL,
     xxh3_128_intdigest_doc},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL, bind_doc},
    {"walk_hits", (PyCFunction)(void (*)(void))walk_hits, METH_FASTCALL, walk_hits_doc},
    {"release_walk", (PyCFunction)(void (*)(void))release_walk, METH_FASTCALL,
     release_walk_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier.manager._native",
    "The scheduler thread's per-block loops, compiled (see kvtier.manager.native).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (resolve_xxh3() < 0) {
        return NULL;
    }
    return PyModule_Create(&module);
}
