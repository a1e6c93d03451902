/* The eager fast path of the sgl_ext ops: key a call's metadata and launch its cached plan in C.
 *
 * An op's Python path checks a call, plans it and launches the Triton kernel once; it then
 * registers the plan in a `Table` under the key this file builds from the call's arguments. A
 * later call with the same metadata is keyed and launched here in one C call: no Python-level
 * attribute reads, no Triton launcher. A call this file cannot key (an object it does not know,
 * a tensor subclass, a tensor DLPack cannot describe), a key with no plan, or active Triton
 * launch hooks return to Python, which runs the checks as before.
 *
 * The key holds, per argument ("leaf"): a tensor's dtype, device, shape, strides, data
 * pointer % 16 and (for the leaves the table names) requires_grad; None; a bool's, int's or
 * float's type and value; for an expanded argument (FusedSetKVBufferArg) its class, then its
 * named attributes as leaves. That is everything the ops' checks read, so a changed input
 * misses. Tensors are read through torch's DLPack exchange API (`__dlpack_c_exchange_api__`):
 * no allocation, no Python call. The stream is torch's current stream of the plan's device
 * (graph capture included). cuLaunchKernelEx is resolved from libcuda with dlsym; a plan's
 * parameter list is checked against cuFuncGetParamInfo when it is registered.
 *
 * The key holds data pointer % 16, not the pointer, so two calls with one key may alias their
 * arguments differently (k_buffer being v_buffer, value being key). For the leaves a table names
 * `written`, a plan also keeps the call's aliasing signature: each pair of a written tensor and
 * another tensor whose byte ranges meet, with their pointer difference. A call launches from C
 * only with the same signature (same metadata and offsets: the same overlap the Python path
 * checked and allowed); any other returns 0, and the Python path checks it (sgl_ext/_alias.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include <ATen/dlpack.h>
#include <cuda.h>

#define MAX_LEAVES 64
#define MAX_PARAMS 64
#define KEY_WORDS 400
#define MAX_EXPAND 2
#define MAX_ATTRS 8
#define MAX_TYPES 4
#define TABLE_CAP 1024 /* slots; a table holding TABLE_CAP / 2 plans is emptied */
#define MAX_ALIAS 16   /* meeting (written, other) pairs a plan may keep */

typedef CUresult (*launch_ex_t)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*param_info_t)(CUfunction, size_t, size_t *, size_t *);
typedef CUresult (*err_str_t)(CUresult, const char **);

static const DLPackExchangeAPI *g_api = NULL;
static PyTypeObject *g_types[MAX_TYPES];
static int g_ntypes = 0;
static PyObject *g_rt = NULL, *g_enter = NULL, *g_exit = NULL;
static PyObject *g_enter_calls = NULL, *g_exit_calls = NULL;
static PyObject *s_enter, *s_exit, *s_requires_grad;
static launch_ex_t p_launch = NULL;
static param_info_t p_param_info = NULL;
static err_str_t p_err_str = NULL;

enum { TAG_TENSOR = 1, TAG_NONE = 2, TAG_BOOL = 3, TAG_INT = 4, TAG_FLOAT = 5, TAG_CLASS = 6,
       TAG_ABSENT = 7, TAG_STR = 8, TAG_TUPLE = 9 };

typedef struct {
  uint64_t hash;
  int32_t nwords;
  int64_t *key; /* NULL: empty slot */
  PyObject *owner; /* keeps the compiled kernel (its module) alive */
  CUfunction fn;
  unsigned grid[3], block, shared;
  int pdl, device, nparams;
  int8_t leaf[MAX_PARAMS]; /* >= 0: that leaf's data pointer; -1: value[] */
  uint64_t value[MAX_PARAMS];
  int nalias; /* the aliasing signature (see the top of the file) */
  int8_t alias_a[MAX_ALIAS], alias_b[MAX_ALIAS];
  int64_t alias_d[MAX_ALIAS];
} Entry;

typedef struct {
  PyObject_HEAD
  Entry *slots;
  Py_ssize_t count;
  int nexp;
  int exp_arg[MAX_EXPAND];
  int exp_nattr[MAX_EXPAND];
  PyObject *exp_attr[MAX_EXPAND][MAX_ATTRS];
  uint64_t grad_mask;    /* leaves whose requires_grad is part of the key */
  uint64_t written_mask; /* leaves written in place: their aliasing is part of a plan */
  int light;             /* tensors keyed by dtype, device and data pointer % 16 only */
} Table;

/* One call's keyed view: the key words, each leaf's data pointer, the references to release. */
typedef struct {
  int64_t key[KEY_WORDS];
  int nwords, nleaves, nheld;
  uintptr_t ptr[MAX_LEAVES];
  uintptr_t end[MAX_LEAVES]; /* a tensor's byte range is [ptr, end); end == ptr: no elements */
  int is_tensor[MAX_LEAVES];
  PyObject *held[MAX_EXPAND * MAX_ATTRS];
} Call;

static void call_release(Call *c) {
  for (int i = 0; i < c->nheld; i++) Py_DECREF(c->held[i]);
  c->nheld = 0;
}

static int is_tensor_type(PyTypeObject *tp) {
  for (int i = 0; i < g_ntypes; i++)
    if (tp == g_types[i]) return 1;
  return 0;
}

#define PUSH(w)                                   \
  do {                                            \
    if (c->nwords >= KEY_WORDS) return 0;         \
    c->key[c->nwords++] = (int64_t)(w);           \
  } while (0)

/* Key a scalar, a str or a tuple of those (inside a tuple leaf). 1: keyed; 0: not. */
static int key_value(Call *c, PyObject *o, int depth) {
  PyTypeObject *tp = Py_TYPE(o);
  if (o == Py_None) {
    PUSH(TAG_NONE);
    return 1;
  }
  if (tp == &PyBool_Type) {
    PUSH(TAG_BOOL | ((int64_t)(o == Py_True) << 8));
    return 1;
  }
  if (tp == &PyLong_Type) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return 0;
    }
    PUSH(TAG_INT);
    PUSH(v);
    return 1;
  }
  if (tp == &PyFloat_Type) {
    double v = PyFloat_AS_DOUBLE(o);
    int64_t bits;
    memcpy(&bits, &v, sizeof bits);
    PUSH(TAG_FLOAT);
    PUSH(bits);
    return 1;
  }
  if (tp == &PyUnicode_Type) { /* by content: a name of a keyword argument */
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(o, &n);
    if (u == NULL) {
      PyErr_Clear();
      return 0;
    }
    if (n > 256) return 0;
    PUSH(TAG_STR | ((int64_t)n << 8));
    for (Py_ssize_t j = 0; j < n; j += 8) {
      int64_t w = 0;
      memcpy(&w, u + j, (size_t)(n - j < 8 ? n - j : 8));
      PUSH(w);
    }
    return 1;
  }
  if (tp == &PyTuple_Type && depth < 2) {
    Py_ssize_t n = PyTuple_GET_SIZE(o);
    PUSH(TAG_TUPLE | ((int64_t)n << 8));
    for (Py_ssize_t j = 0; j < n; j++)
      if (!key_value(c, PyTuple_GET_ITEM(o, j), depth + 1)) return 0;
    return 1;
  }
  return 0;
}

/* Key one leaf. 1: keyed; 0: not keyable here (no Python error left set). */
static int key_leaf(Table *t, Call *c, PyObject *o) {
  int i = c->nleaves;
  if (i >= MAX_LEAVES) return 0;
  c->nleaves++;
  c->ptr[i] = 0;
  c->is_tensor[i] = 0;
  if (o == NULL) {
    PUSH(TAG_ABSENT);
    return 1;
  }
  if (o == Py_None) {
    PUSH(TAG_NONE);
    return 1;
  }
  PyTypeObject *tp = Py_TYPE(o);
  if (is_tensor_type(tp)) {
    DLTensor dl;
    if (g_api == NULL || g_api->dltensor_from_py_object_no_sync(o, &dl) != 0) {
      PyErr_Clear();
      return 0;
    }
    if (dl.ndim < 0 || dl.ndim > 8 || (dl.ndim > 0 && dl.strides == NULL)) return 0;
    uintptr_t p = (uintptr_t)dl.data + (uintptr_t)dl.byte_offset;
    uint64_t elem = ((uint64_t)dl.dtype.bits * dl.dtype.lanes + 7) / 8, span = elem;
    for (int d = 0; d < dl.ndim; d++) {
      if (dl.shape[d] == 0) span = 0;
      if (dl.strides[d] < 0) return 0; /* torch has none; the byte range would be wrong */
    }
    for (int d = 0; span && d < dl.ndim; d++)
      span += (uint64_t)(dl.shape[d] - 1) * (uint64_t)dl.strides[d] * elem;
    int64_t grad = 0;
    if (t->grad_mask & ((uint64_t)1 << i)) {
      PyObject *rg = PyObject_GetAttr(o, s_requires_grad);
      if (rg == NULL) {
        PyErr_Clear();
        return 0;
      }
      grad = rg == Py_True;
      Py_DECREF(rg);
    }
    int64_t ndim = t->light ? 0 : dl.ndim; /* a light key holds no shape */
    PUSH(TAG_TENSOR | (ndim << 8) | ((int64_t)dl.dtype.code << 16) |
         ((int64_t)dl.dtype.bits << 24) | ((int64_t)dl.dtype.lanes << 32));
    PUSH((int64_t)dl.device.device_type | ((int64_t)dl.device.device_id << 32));
    for (int d = 0; d < ndim; d++) PUSH(dl.shape[d]);
    for (int d = 0; d < ndim; d++) PUSH(dl.strides[d]);
    PUSH((int64_t)(p & 15) | (grad << 8));
    c->ptr[i] = p;
    c->end[i] = p + span;
    c->is_tensor[i] = 1;
    return 1;
  }
  return key_value(c, o, 0);
}

/* A call's aliasing signature into a, b, d: each pair (written leaf, other tensor leaf) whose
 * byte ranges meet, in leaf order, with the pointer difference. The count, or -1 past
 * MAX_ALIAS. */
static int alias_signature(const Table *t, const Call *c, int8_t *a, int8_t *b, int64_t *d) {
  int n = 0;
  if (t->written_mask == 0) return 0;
  for (int i = 0; i < c->nleaves; i++) {
    if (!(t->written_mask & ((uint64_t)1 << i)) || !c->is_tensor[i] || c->end[i] == c->ptr[i])
      continue;
    for (int j = 0; j < c->nleaves; j++) {
      if (j == i || !c->is_tensor[j] || c->end[j] == c->ptr[j]) continue;
      if (j < i && (t->written_mask & ((uint64_t)1 << j))) continue; /* counted as (j, i) */
      if (c->ptr[j] >= c->end[i] || c->ptr[i] >= c->end[j]) continue;
      if (n >= MAX_ALIAS) return -1;
      a[n] = (int8_t)i;
      b[n] = (int8_t)j;
      d[n++] = (int64_t)(c->ptr[j] - c->ptr[i]);
    }
  }
  return n;
}

/* Whether a call aliases its arguments as the plan's call did (see alias_signature). */
static int alias_matches(const Table *t, const Call *c, const Entry *e) {
  int8_t a[MAX_ALIAS], b[MAX_ALIAS];
  int64_t d[MAX_ALIAS];
  int n = alias_signature(t, c, a, b, d);
  if (n != e->nalias) return 0;
  for (int k = 0; k < n; k++)
    if (a[k] != e->alias_a[k] || b[k] != e->alias_b[k] || d[k] != e->alias_d[k]) return 0;
  return 1;
}

/* Key a call's arguments (expanding the table's expanded arguments). 1: keyed; 0: not. */
static int key_call(Table *t, Call *c, PyObject *const *args, Py_ssize_t nargs) {
  c->nwords = c->nleaves = c->nheld = 0;
  PUSH(nargs);
  for (Py_ssize_t a = 0; a < nargs; a++) {
    PyObject *o = args[a];
    int e = -1;
    for (int k = 0; k < t->nexp; k++)
      if (t->exp_arg[k] == a) e = k;
    if (e < 0) {
      if (!key_leaf(t, c, o)) return 0;
      continue;
    }
    /* an expanded argument: its class, then its attributes (absent when it is None) */
    if (c->nleaves >= MAX_LEAVES) return 0;
    c->ptr[c->nleaves] = 0;
    c->is_tensor[c->nleaves++] = 0;
    PUSH(TAG_CLASS);
    PUSH((intptr_t)Py_TYPE(o));
    for (int k = 0; k < t->exp_nattr[e]; k++) {
      PyObject *v = NULL;
      if (o != Py_None) {
        v = PyObject_GetAttr(o, t->exp_attr[e][k]);
        if (v == NULL) {
          PyErr_Clear();
          return 0;
        }
        c->held[c->nheld++] = v;
      }
      if (!key_leaf(t, c, v)) return 0;
    }
  }
  return 1;
}

static uint64_t hash_key(const int64_t *w, int n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (int i = 0; i < n; i++) {
    h ^= (uint64_t)w[i];
    h *= 0x100000001b3ULL;
    h ^= h >> 29;
  }
  return h ? h : 1;
}

/* The slot of a key: its entry, or the empty slot where it would go. */
static Entry *find_slot(Table *t, const int64_t *key, int n, uint64_t h) {
  size_t mask = TABLE_CAP - 1;
  for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
    Entry *e = &t->slots[i];
    if (e->key == NULL) return e;
    if (e->hash == h && e->nwords == n && memcmp(e->key, key, sizeof(int64_t) * n) == 0)
      return e;
  }
}

static void table_clear_slots(Table *t) {
  for (size_t i = 0; i < TABLE_CAP; i++) {
    PyMem_Free(t->slots[i].key);
    t->slots[i].key = NULL;
    Py_CLEAR(t->slots[i].owner);
  }
  t->count = 0;
}

static int hooks_clear(void) {
  if (g_rt == NULL) return 1;
  PyObject *names[2] = {s_enter, s_exit};
  PyObject *orig[2] = {g_enter, g_exit};
  PyObject *calls[2] = {g_enter_calls, g_exit_calls};
  for (int k = 0; k < 2; k++) {
    PyObject *h = PyObject_GetAttr(g_rt, names[k]);
    if (h == NULL) {
      PyErr_Clear();
      return 0;
    }
    int ok = h == Py_None ||
             (h == orig[k] && (calls[k] == NULL || PyList_GET_SIZE(calls[k]) == 0));
    Py_DECREF(h);
    if (!ok) return 0;
  }
  return 1;
}

static PyObject *cuda_error(CUresult rc, const char *what) {
  const char *s = NULL;
  if (p_err_str) p_err_str(rc, &s);
  PyErr_Format(PyExc_RuntimeError, "sgl_ext fast launch: %s failed: %s (%d)", what,
               s ? s : "unknown error", (int)rc);
  return NULL;
}

/* Launch an entry with its leaves' data pointers. A new reference to 1, or NULL (error). */
static PyObject *entry_launch(const Entry *e, const uintptr_t *ptr) {
  uint64_t vals[MAX_PARAMS];
  void *params[MAX_PARAMS];
  for (int i = 0; i < e->nparams; i++) {
    int l = e->leaf[i];
    vals[i] = l >= 0 ? (uint64_t)ptr[l] : e->value[i];
    params[i] = &vals[i];
  }
  if ((uint64_t)e->grid[0] * e->grid[1] * e->grid[2] == 0) return PyLong_FromLong(1);
  void *stream = NULL;
  if (g_api->current_work_stream(kDLCUDA, e->device, &stream) != 0) return NULL;
  CUlaunchAttribute attr[1];
  CUlaunchConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.gridDimX = e->grid[0];
  cfg.gridDimY = e->grid[1];
  cfg.gridDimZ = e->grid[2];
  cfg.blockDimX = e->block;
  cfg.blockDimY = cfg.blockDimZ = 1;
  cfg.sharedMemBytes = e->shared;
  cfg.hStream = (CUstream)stream;
  cfg.attrs = attr;
  cfg.numAttrs = 0;
  if (e->pdl) {
    memset(attr, 0, sizeof attr);
    attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr[0].value.programmaticStreamSerializationAllowed = 1;
    cfg.numAttrs = 1;
  }
  CUresult rc = p_launch(&cfg, e->fn, params, NULL);
  if (rc != CUDA_SUCCESS) return cuda_error(rc, "cuLaunchKernelEx");
  return PyLong_FromLong(1);
}

/* table.launch(*args) -> 1 launched, 0 no plan for this key (register one), -1 not keyable
 * here or hooks active (take the Python path, do not register). */
static PyObject *table_launch(Table *t, PyObject *const *args, Py_ssize_t nargs) {
  Call c;
  if (!key_call(t, &c, args, nargs) || !hooks_clear()) {
    call_release(&c);
    return PyLong_FromLong(-1);
  }
  Entry *e = find_slot(t, c.key, c.nwords, hash_key(c.key, c.nwords));
  call_release(&c);
  if (e->key == NULL || !alias_matches(t, &c, e)) return PyLong_FromLong(0);
  if (e->fn == NULL || p_launch == NULL) return PyLong_FromLong(-1);
  return entry_launch(e, c.ptr);
}

/* Parse a launch spec into e (not its key): (owner, function, (gx, gy, gz), threads, shared,
 * pdl, device, params); params a tuple of (leaf, size, value): leaf >= 0 takes that leaf's
 * data pointer (is_tensor[leaf] must hold), -1 the value (size bytes, little end). The
 * parameter list must match the kernel's (cuFuncGetParamInfo), up to trailing 8-byte
 * parameters passed as 0 (Triton's scratch pointers). Function 0 makes an entry that never
 * launches (tests without CUDA). 1: parsed (e holds a reference to owner); 0: refused; -1:
 * error. */
static int parse_spec(PyObject *spec, Entry *e, int nleaves, const int *is_tensor) {
  unsigned long long fn = 0;
  unsigned gx, gy, gz, block, shared;
  int pdl, device;
  PyObject *params, *owner;
  if (!PyTuple_Check(spec)) {
    PyErr_SetString(PyExc_TypeError, "spec must be a tuple");
    return -1;
  }
  if (!PyArg_ParseTuple(spec, "OK(III)IIpiO!", &owner, &fn, &gx, &gy, &gz, &block, &shared,
                        &pdl, &device, &PyTuple_Type, &params))
    return -1;
  Py_ssize_t np = PyTuple_GET_SIZE(params);
  if (np > MAX_PARAMS) return 0;
  memset(e, 0, sizeof *e);
  for (Py_ssize_t i = 0; i < np; i++) {
    long leaf;
    unsigned size;
    unsigned long long value;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(params, i), "lIK", &leaf, &size, &value)) return -1;
    if (leaf >= 0 && (leaf >= nleaves || !is_tensor[leaf] || size != 8)) return 0;
    if (size != 1 && size != 2 && size != 4 && size != 8) return 0;
    e->leaf[i] = (int8_t)(leaf >= 0 ? leaf : -1);
    e->value[i] = value;
    if (fn) {
      size_t off = 0, sz = 0;
      if (p_param_info == NULL ||
          p_param_info((CUfunction)(uintptr_t)fn, (size_t)i, &off, &sz) != CUDA_SUCCESS ||
          sz != size)
        return 0;
    }
  }
  if (fn) {
    if (p_param_info == NULL || p_launch == NULL) return 0;
    size_t off = 0, sz = 0;
    while (p_param_info((CUfunction)(uintptr_t)fn, (size_t)np, &off, &sz) == CUDA_SUCCESS) {
      if (sz != 8 || np >= MAX_PARAMS) return 0;
      e->leaf[np] = -1;
      e->value[np++] = 0;
    }
    if (np - PyTuple_GET_SIZE(params) > 2) return 0;
  }
  e->fn = (CUfunction)(uintptr_t)fn;
  e->grid[0] = gx;
  e->grid[1] = gy;
  e->grid[2] = gz;
  e->block = block;
  e->shared = shared;
  e->pdl = pdl;
  e->device = device;
  e->nparams = (int)np;
  Py_INCREF(owner);
  e->owner = owner;
  return 1;
}

/* table.register(spec, *args) -> True if stored under the key of args (see parse_spec). */
static PyObject *table_register(Table *t, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "register(spec, *args)");
    return NULL;
  }
  Call c;
  int keyed = key_call(t, &c, args + 1, nargs - 1);
  call_release(&c);
  if (!keyed) Py_RETURN_FALSE;
  Entry tmp;
  int r = parse_spec(args[0], &tmp, c.nleaves, c.is_tensor);
  if (r < 0) return NULL;
  if (r == 0) Py_RETURN_FALSE;
  tmp.nalias = alias_signature(t, &c, tmp.alias_a, tmp.alias_b, tmp.alias_d);
  if (tmp.nalias < 0) {
    Py_DECREF(tmp.owner);
    Py_RETURN_FALSE;
  }
  if (t->count >= TABLE_CAP / 2) table_clear_slots(t);
  uint64_t h = hash_key(c.key, c.nwords);
  Entry *e = find_slot(t, c.key, c.nwords, h);
  int64_t *key = e->key;
  Py_CLEAR(e->owner);
  if (key == NULL) {
    key = PyMem_Malloc(sizeof(int64_t) * c.nwords);
    if (key == NULL) {
      Py_DECREF(tmp.owner);
      return PyErr_NoMemory();
    }
    memcpy(key, c.key, sizeof(int64_t) * c.nwords);
    t->count++;
  }
  *e = tmp;
  e->key = key;
  e->hash = h;
  e->nwords = c.nwords;
  Py_RETURN_TRUE;
}

/* table.key(*args) -> the key as bytes, or None where the call is not keyable here. */
static PyObject *table_key(Table *t, PyObject *const *args, Py_ssize_t nargs) {
  Call c;
  int ok = key_call(t, &c, args, nargs);
  call_release(&c);
  if (!ok) Py_RETURN_NONE;
  return PyBytes_FromStringAndSize((const char *)c.key, sizeof(int64_t) * c.nwords);
}

/* table.probe(*args) -> whether a plan is stored under the call's key (for its aliasing). */
static PyObject *table_probe(Table *t, PyObject *const *args, Py_ssize_t nargs) {
  Call c;
  int ok = key_call(t, &c, args, nargs);
  call_release(&c);
  if (!ok) Py_RETURN_FALSE;
  Entry *e = find_slot(t, c.key, c.nwords, hash_key(c.key, c.nwords));
  return PyBool_FromLong(e->key != NULL && alias_matches(t, &c, e));
}

static PyObject *table_clear(Table *t, PyObject *unused) {
  table_clear_slots(t);
  Py_RETURN_NONE;
}

static Py_ssize_t table_len(Table *t) { return t->count; }

/* The bit mask of a sequence of leaf indexes (0 with an error set if one is out of range). */
static int leaf_mask(PyObject *leaves, uint64_t *mask) {
  *mask = 0;
  if (leaves == NULL || leaves == Py_None) return 1;
  PyObject *seq = PySequence_Fast(leaves, "leaves must be a sequence");
  if (!seq) return 0;
  for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq); k++) {
    long l = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, k));
    if (l < 0 || l >= 64) {
      Py_DECREF(seq);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "leaf out of range");
      return 0;
    }
    *mask |= (uint64_t)1 << l;
  }
  Py_DECREF(seq);
  return 1;
}

/* Table(expand=((arg_index, (attr, ...)), ...), grad=(leaf, ...), light=False,
 *       written=(leaf, ...)) */
static int table_init(Table *t, PyObject *args, PyObject *kwds) {
  static char *kw[] = {"expand", "grad", "light", "written", NULL};
  PyObject *expand = NULL, *grad = NULL, *written = NULL;
  int light = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OOpO", kw, &expand, &grad, &light, &written))
    return -1;
  if (t->slots != NULL) {
    PyErr_SetString(PyExc_RuntimeError, "Table already initialised");
    return -1;
  }
  t->light = light;
  t->slots = PyMem_Calloc(TABLE_CAP, sizeof(Entry));
  if (t->slots == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  t->nexp = 0;
  if (expand && expand != Py_None) {
    PyObject *seq = PySequence_Fast(expand, "expand must be a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_EXPAND) {
      Py_DECREF(seq);
      PyErr_SetString(PyExc_ValueError, "too many expanded arguments");
      return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
      int idx;
      PyObject *names;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "iO!", &idx, &PyTuple_Type,
                            &names) ||
          PyTuple_GET_SIZE(names) > MAX_ATTRS) {
        Py_DECREF(seq);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "too many attributes");
        return -1;
      }
      t->exp_arg[k] = idx;
      t->exp_nattr[k] = (int)PyTuple_GET_SIZE(names);
      for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(names); j++) {
        PyObject *s = PyTuple_GET_ITEM(names, j);
        if (!PyUnicode_Check(s)) {
          Py_DECREF(seq);
          PyErr_SetString(PyExc_TypeError, "attribute names must be str");
          return -1;
        }
        Py_INCREF(s);
        PyUnicode_InternInPlace(&s);
        t->exp_attr[k][j] = s;
      }
      t->nexp++;
    }
    Py_DECREF(seq);
  }
  if (!leaf_mask(grad, &t->grad_mask) || !leaf_mask(written, &t->written_mask)) return -1;
  if (light) t->written_mask = 0; /* a light key holds no shapes: no byte ranges */
  return 0;
}

static void table_dealloc(Table *t) {
  if (t->slots) {
    table_clear_slots(t);
    PyMem_Free(t->slots);
  }
  for (int k = 0; k < t->nexp; k++)
    for (int j = 0; j < t->exp_nattr[k]; j++) Py_XDECREF(t->exp_attr[k][j]);
  Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef table_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))table_launch, METH_FASTCALL, NULL},
    {"register", (PyCFunction)(void (*)(void))table_register, METH_FASTCALL, NULL},
    {"key", (PyCFunction)(void (*)(void))table_key, METH_FASTCALL, NULL},
    {"probe", (PyCFunction)(void (*)(void))table_probe, METH_FASTCALL, NULL},
    {"clear", (PyCFunction)table_clear, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL}};

static PySequenceMethods table_as_seq = {.sq_length = (lenfunc)table_len};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sgl_ext_fast_launch.Table",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)table_init,
    .tp_dealloc = (destructor)table_dealloc,
    .tp_methods = table_methods,
    .tp_as_sequence = &table_as_seq,
};

/* Plan(spec, nptrs): one launch plan without a key, for a caller that knows its plan and has
 * the per-call pointers as ints: plan.launch(*ptrs) -> True launched, False hooks active
 * (launch through Triton). Leaf i of the spec is ptrs[i]. */
typedef struct {
  PyObject_HEAD
  Entry e;
  int nptrs;
} Plan;

static int plan_init(Plan *p, PyObject *args, PyObject *kwds) {
  PyObject *spec;
  int nptrs;
  if (!PyArg_ParseTuple(args, "Oi", &spec, &nptrs)) return -1;
  if (p->e.owner != NULL) {
    PyErr_SetString(PyExc_RuntimeError, "Plan already initialised");
    return -1;
  }
  if (nptrs < 0 || nptrs > MAX_LEAVES) {
    PyErr_SetString(PyExc_ValueError, "nptrs out of range");
    return -1;
  }
  int all[MAX_LEAVES];
  for (int i = 0; i < MAX_LEAVES; i++) all[i] = 1;
  int r = parse_spec(spec, &p->e, nptrs, all);
  if (r < 0) return -1;
  if (r == 0 || p->e.fn == NULL) {
    Py_CLEAR(p->e.owner);
    PyErr_SetString(PyExc_ValueError, "this kernel cannot be launched from C");
    return -1;
  }
  p->nptrs = nptrs;
  return 0;
}

static PyObject *plan_launch(Plan *p, PyObject *const *args, Py_ssize_t nargs) {
  if (p->e.fn == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "Plan not initialised");
    return NULL;
  }
  if (nargs != p->nptrs) {
    PyErr_Format(PyExc_TypeError, "launch takes %d pointers, got %zd", p->nptrs, nargs);
    return NULL;
  }
  uintptr_t ptr[MAX_LEAVES];
  for (Py_ssize_t i = 0; i < nargs; i++) {
    unsigned long long v = PyLong_AsUnsignedLongLong(args[i]);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    ptr[i] = (uintptr_t)v;
  }
  if (!hooks_clear()) Py_RETURN_FALSE;
  PyObject *r = entry_launch(&p->e, ptr);
  if (r == NULL) return NULL;
  Py_DECREF(r);
  Py_RETURN_TRUE;
}

static void plan_dealloc(Plan *p) {
  Py_CLEAR(p->e.owner);
  Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef plan_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))plan_launch, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL}};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "sgl_ext_fast_launch.Plan",
    .tp_basicsize = sizeof(Plan),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)plan_init,
    .tp_dealloc = (destructor)plan_dealloc,
    .tp_methods = plan_methods,
};

/* init(api_capsule, tensor_types, runtime_knobs, enter_hook, exit_hook, enter_calls,
 *      exit_calls) -> whether libcuda was found (launches possible). */
static PyObject *mod_init(PyObject *self, PyObject *args) {
  PyObject *capsule, *types, *rt, *enter, *exit_, *ec, *xc;
  if (!PyArg_ParseTuple(args, "OO!OOOOO", &capsule, &PyTuple_Type, &types, &rt, &enter, &exit_,
                        &ec, &xc))
    return NULL;
  const DLPackExchangeAPI *api = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
  if (api == NULL) return NULL;
  if (api->header.version.major != DLPACK_MAJOR_VERSION || api->dltensor_from_py_object_no_sync ==
                                                               NULL ||
      api->current_work_stream == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "unsupported DLPack exchange API");
    return NULL;
  }
  if (PyTuple_GET_SIZE(types) > MAX_TYPES) {
    PyErr_SetString(PyExc_ValueError, "too many tensor types");
    return NULL;
  }
  g_api = api;
  g_ntypes = 0;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); i++) {
    PyObject *tp = PyTuple_GET_ITEM(types, i);
    if (!PyType_Check(tp)) {
      PyErr_SetString(PyExc_TypeError, "tensor_types must be types");
      return NULL;
    }
    Py_INCREF(tp);
    g_types[g_ntypes++] = (PyTypeObject *)tp;
  }
  PyObject *objs[5] = {rt, enter, exit_, ec, xc};
  PyObject **dst[5] = {&g_rt, &g_enter, &g_exit, &g_enter_calls, &g_exit_calls};
  for (int k = 0; k < 5; k++) {
    Py_XDECREF(*dst[k]);
    *dst[k] = NULL;
    if (objs[k] != Py_None) {
      if (k >= 3 && !PyList_Check(objs[k])) {
        PyErr_SetString(PyExc_TypeError, "hook calls must be lists");
        return NULL;
      }
      Py_INCREF(objs[k]);
      *dst[k] = objs[k];
    }
  }
  if (p_launch == NULL) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib != NULL) {
      p_launch = (launch_ex_t)dlsym(lib, "cuLaunchKernelEx");
      p_param_info = (param_info_t)dlsym(lib, "cuFuncGetParamInfo");
      p_err_str = (err_str_t)dlsym(lib, "cuGetErrorString");
      if (p_param_info == NULL) p_launch = NULL; /* cannot check plans: never launch */
    }
  }
  return PyBool_FromLong(p_launch != NULL);
}

static PyMethodDef mod_methods[] = {{"init", mod_init, METH_VARARGS, NULL}, {NULL, NULL, 0, NULL}};

static struct PyModuleDef mod_def = {PyModuleDef_HEAD_INIT, "sgl_ext_fast_launch", NULL, -1,
                                     mod_methods};

PyMODINIT_FUNC PyInit_sgl_ext_fast_launch(void) {
  s_enter = PyUnicode_InternFromString("launch_enter_hook");
  s_exit = PyUnicode_InternFromString("launch_exit_hook");
  s_requires_grad = PyUnicode_InternFromString("requires_grad");
  if (PyType_Ready(&TableType) < 0 || PyType_Ready(&PlanType) < 0) return NULL;
  PyObject *m = PyModule_Create(&mod_def);
  if (m == NULL) return NULL;
  Py_INCREF(&TableType);
  if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0) return NULL;
  Py_INCREF(&PlanType);
  if (PyModule_AddObject(m, "Plan", (PyObject *)&PlanType) < 0) return NULL;
  return m;
}
