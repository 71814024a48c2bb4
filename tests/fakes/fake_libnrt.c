/* FAKE libnrt for qic's tests: the nrt.h calls qic's loader uses, on host memory, recording each call.
 * It is not the Neuron runtime and runs no NEFF; it exists so the loader's call order, tensor names,
 * sizes and bytes can be checked on machines without Trainium.
 *
 * Build: gcc -shared -fPIC -o libnrt_fake.so fake_libnrt.c
 * Log:   every call appends one JSON line to $QIC_FAKE_LIBNRT_LOG (when set).
 *
 * Fake NEFF format (text, written by the tests, not by any compiler):
 *   QIC-FAKE-NEFF-IO
 *   in <name> <nrt dtype code> <dim> <dim> ...
 *   out <name> <nrt dtype code> <dim> ...
 * Tensors are listed to the caller sorted by name (strcmp), so input10 comes before input2, as a
 * std::map-ordered runtime would list them.
 *
 * Execute (float32 only): output0[i] = input0[i] + sum over k >= 1 of k * (first float of input<k>).
 * Weighting by k makes any mix-up of input order change the result. Other outputs are zeroed.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int NRT_STATUS;
#define MAX_TENSORS 256
#define NAME_MAX_LEN 256

typedef struct fake_tensor {
    char name[NAME_MAX_LEN];
    size_t size;
    unsigned char *data;
} fake_tensor;

/* Layout of nrt_tensor_info_t / nrt_tensor_info_array_t as declared in nrt_experimental.h. */
typedef struct info_entry {
    char name[NAME_MAX_LEN];
    int usage;
    size_t size;
    int dtype;
    uint32_t *shape;
    uint32_t ndim;
} info_entry;

typedef struct info_array {
    uint64_t count;
    info_entry entries[];
} info_array;

typedef struct fake_model {
    int count;
    info_entry io[MAX_TENSORS];
} fake_model;

typedef struct fake_set {
    int count;
    char names[MAX_TENSORS][NAME_MAX_LEN];
    fake_tensor *tensors[MAX_TENSORS];
} fake_set;

static int initialized = 0;

static void logf_json(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void logf_json(const char *fmt, ...) {
    const char *path = getenv("QIC_FAKE_LIBNRT_LOG");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
}

static uint64_t fnv1a64(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 1099511628211ULL; }
    return h;
}

static size_t dtype_size(int code) {
    switch (code) {
    case 0xA: case 0x8: case 0x9: return 4;   /* float32, int32, uint32 */
    case 0x6: case 0x7: case 0x4: case 0x5: return 2;
    case 0xC: case 0x1: return 8;
    case 0x2: case 0x3: return 1;
    default: return 0;
    }
}

NRT_STATUS nrt_init(int framework, const char *fw_version, const char *fal_version) {
    const char *cores = getenv("NEURON_RT_VISIBLE_CORES");
    const char *lnc = getenv("NEURON_LOGICAL_NC_CONFIG");
    const char *comm = getenv("NEURON_RT_ROOT_COMM_ID");
    logf_json("{\"call\":\"nrt_init\",\"framework\":%d,\"fw\":\"%s\",\"fal\":\"%s\",\"visible_cores\":\"%s\","
              "\"lnc\":\"%s\",\"comm_id\":\"%s\"}", framework, fw_version ? fw_version : "",
              fal_version ? fal_version : "", cores ? cores : "", lnc ? lnc : "", comm ? comm : "");
    if (initialized) return 1;
    initialized = 1;
    return 0;
}

void nrt_close(void) {
    logf_json("{\"call\":\"nrt_close\"}");
    initialized = 0;
}

static int by_name(const void *a, const void *b) {
    return strcmp(((const info_entry *)a)->name, ((const info_entry *)b)->name);
}

static NRT_STATUS parse_neff(const void *bytes, size_t size, fake_model **out) {
    char *text = malloc(size + 1);
    memcpy(text, bytes, size);
    text[size] = 0;
    if (strncmp(text, "QIC-FAKE-NEFF-IO\n", 17) != 0) { free(text); return 2; }  /* NRT_INVALID */
    fake_model *m = calloc(1, sizeof(fake_model));
    char *save = NULL;
    for (char *line = strtok_r(text + 17, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char kind[8], name[NAME_MAX_LEN];
        int code, used = 0;
        if (sscanf(line, "%7s %255s %d%n", kind, name, &code, &used) != 3 || m->count >= MAX_TENSORS) continue;
        info_entry *e = &m->io[m->count++];
        strcpy(e->name, name);
        e->usage = strcmp(kind, "in") == 0 ? 0 : 1;
        e->dtype = code;
        e->shape = calloc(8, sizeof(uint32_t));
        size_t numel = 1;
        char *rest = line + used;
        unsigned dim;
        int n;
        while (e->ndim < 8 && sscanf(rest, "%u%n", &dim, &n) == 1) {
            e->shape[e->ndim++] = dim;
            numel *= dim;
            rest += n;
        }
        e->size = numel * dtype_size(code);
    }
    free(text);
    qsort(m->io, m->count, sizeof(info_entry), by_name);
    *out = m;
    return 0;
}

NRT_STATUS nrt_load(const void *neff, size_t size, int32_t vnc, int32_t vnc_count, void **model) {
    logf_json("{\"call\":\"nrt_load\",\"neff_bytes\":%zu,\"vnc\":%d,\"vnc_count\":%d}", size, vnc, vnc_count);
    if (!initialized) return 13;
    return parse_neff(neff, size, (fake_model **)model);
}

NRT_STATUS nrt_load_collectives(const void *neff, size_t size, int32_t vnc, int32_t vnc_count,
                                uint32_t device_id, uint32_t device_count, void **model) {
    logf_json("{\"call\":\"nrt_load_collectives\",\"neff_bytes\":%zu,\"vnc\":%d,\"vnc_count\":%d,"
              "\"rank\":%u,\"world\":%u}", size, vnc, vnc_count, device_id, device_count);
    if (!initialized) return 13;
    if (device_id >= device_count) return 2;
    return parse_neff(neff, size, (fake_model **)model);
}

NRT_STATUS nrt_unload(void *model) {
    logf_json("{\"call\":\"nrt_unload\"}");
    fake_model *m = model;
    for (int i = 0; i < m->count; i++) free(m->io[i].shape);
    free(m);
    return 0;
}

NRT_STATUS nrt_get_model_tensor_info(void *model, info_array **info) {
    fake_model *m = model;
    info_array *a = calloc(1, sizeof(info_array) + m->count * sizeof(info_entry));
    a->count = m->count;
    memcpy(a->entries, m->io, m->count * sizeof(info_entry));
    *info = a;
    logf_json("{\"call\":\"nrt_get_model_tensor_info\",\"count\":%d}", m->count);
    return 0;
}

NRT_STATUS nrt_free_model_tensor_info(info_array *info) {
    free(info);
    return 0;
}

NRT_STATUS nrt_tensor_allocate(int placement, int vnc, size_t size, const char *name, fake_tensor **tensor) {
    logf_json("{\"call\":\"nrt_tensor_allocate\",\"placement\":%d,\"vnc\":%d,\"size\":%zu,\"name\":\"%s\"}",
              placement, vnc, size, name ? name : "");
    fake_tensor *t = calloc(1, sizeof(fake_tensor));
    snprintf(t->name, NAME_MAX_LEN, "%s", name ? name : "");
    t->size = size;
    t->data = calloc(1, size ? size : 1);
    *tensor = t;
    return 0;
}

void nrt_tensor_free(fake_tensor **tensor) {
    if (!tensor || !*tensor) return;
    logf_json("{\"call\":\"nrt_tensor_free\",\"name\":\"%s\"}", (*tensor)->name);
    free((*tensor)->data);
    free(*tensor);
    *tensor = NULL;
}

NRT_STATUS nrt_tensor_write(fake_tensor *t, const void *buf, size_t offset, size_t size) {
    if (offset + size > t->size) return 2;
    memcpy(t->data + offset, buf, size);
    logf_json("{\"call\":\"nrt_tensor_write\",\"name\":\"%s\",\"offset\":%zu,\"size\":%zu,\"fnv1a64\":\"%016llx\"}",
              t->name, offset, size, (unsigned long long)fnv1a64(t->data + offset, size));
    return 0;
}

NRT_STATUS nrt_tensor_read(const fake_tensor *t, void *buf, size_t offset, size_t size) {
    logf_json("{\"call\":\"nrt_tensor_read\",\"name\":\"%s\",\"offset\":%zu,\"size\":%zu}", t->name, offset, size);
    if (offset + size > t->size) return 2;
    memcpy(buf, t->data + offset, size);
    return 0;
}

NRT_STATUS nrt_allocate_tensor_set(fake_set **set) {
    *set = calloc(1, sizeof(fake_set));
    logf_json("{\"call\":\"nrt_allocate_tensor_set\"}");
    return 0;
}

void nrt_destroy_tensor_set(fake_set **set) {
    logf_json("{\"call\":\"nrt_destroy_tensor_set\"}");
    free(*set);
    *set = NULL;
}

NRT_STATUS nrt_add_tensor_to_tensor_set(fake_set *set, const char *name, fake_tensor *t) {
    logf_json("{\"call\":\"nrt_add_tensor_to_tensor_set\",\"name\":\"%s\",\"tensor\":\"%s\"}", name, t->name);
    if (set->count >= MAX_TENSORS) return 4;
    snprintf(set->names[set->count], NAME_MAX_LEN, "%s", name);
    set->tensors[set->count++] = t;
    return 0;
}

static fake_tensor *lookup(const fake_set *set, const char *name) {
    for (int i = 0; i < set->count; i++)
        if (strcmp(set->names[i], name) == 0) return set->tensors[i];
    return NULL;
}

NRT_STATUS nrt_execute(void *model, const fake_set *inputs, fake_set *outputs) {
    fake_model *m = model;
    logf_json("{\"call\":\"nrt_execute\",\"inputs\":%d,\"outputs\":%d}", inputs->count, outputs->count);
    float bias = 0;
    for (int i = 0; i < m->count; i++) {          /* every NEFF tensor must be bound, with its size */
        fake_tensor *t = lookup(m->io[i].usage == 0 ? inputs : outputs, m->io[i].name);
        if (!t || t->size != m->io[i].size) return 1002;                     /* NRT_EXEC_BAD_INPUT */
        int k;
        if (m->io[i].usage == 0 && sscanf(m->io[i].name, "input%d", &k) == 1 && k >= 1 && t->size >= 4)
            bias += k * ((float *)t->data)[0];
    }
    fake_tensor *in0 = lookup(inputs, "input0");
    for (int i = 0; i < outputs->count; i++) {
        fake_tensor *o = outputs->tensors[i];
        memset(o->data, 0, o->size);
        if (strcmp(outputs->names[i], "output0") == 0 && in0 && in0->size == o->size)
            for (size_t j = 0; j < o->size / 4; j++) ((float *)o->data)[j] = ((float *)in0->data)[j] + bias;
    }
    return 0;
}
