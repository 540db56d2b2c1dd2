/* fakegpu libcuda: reading module images (fatbins, cubins, PTX) far enough to know their kernels
 * and global variables, so that cuModuleGetFunction / cuLibraryGetKernel / cuModuleGetGlobal
 * answer as the real driver does (CUDA_ERROR_NOT_FOUND for a name the image does not define).
 *
 * Formats, from public sources:
 *  - the fatbin wrapper `__fatBinC_Wrapper_t` {int magic 0x466243b1, int version (1: data is one
 *    fatbin; 2: filename_or_fatbins is a NULL-terminated array of fatbins, relocatable device
 *    code), const void *data, void *filename_or_fatbins}: CUDA's fatbinary_section.h as quoted
 *    in vosen/ZLUDA cuda_types/src/dark_api.rs;
 *  - the fatbin container {u32 magic 0xba55ed50, u16 version 1, u16 header_size, u64 size of the
 *    entries}, each entry {u16 kind (1 PTX, 2 ELF), u16 version 0x101, u32 header_size, u32
 *    payload_size, u32, u32 compressed_size, ..., u64 flags @40 (0x2000 LZ4, 0x8000 zstd),
 *    u64, u64 uncompressed size @56} followed by its payload: ZLUDA dark_api/src/fatbin.rs and
 *    cuda_types/src/dark_api.rs, checked against what nvcc 13.0 writes here (`nvcc -fatbin`: the
 *    cubin uncompressed, the PTX zstd-compressed);
 *  - cubins are ELF64: kernels are FUNC symbols with st_other bit 0x10 (STO_CUDA_ENTRY), device
 *    variables OBJECT symbols in .nv.global* / .nv.constantN sections (readelf on nvcc's output);
 *  - PTX: `.entry NAME(` declares a kernel, top-level `.global` / `.const` declarations variables
 *    (PTX ISA, "Kernel Function Declarations and Definitions", "Variables").
 * LZ4 block decompression is written here from the LZ4 block format description (lz4/lz4
 * doc/lz4_Block_format.md); zstd payloads go through the system's libzstd.so.1 when it can be
 * loaded.  An entry that cannot be read (zstd without libzstd) makes the image "opaque": its
 * names are then accepted as asked (docs/developers/simulators.md, "Kernel model").
 */
#include "fg_cuda.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#define WRAPPER_MAGIC 0x466243b1u
#define FATBIN_MAGIC 0xba55ed50u
#define MAX_IMAGE (512ULL << 20)

static int add_kernel(struct fg_image_syms *s, const char *name, size_t len)
{
    for (int i = 0; i < s->nkern; i++)
        if (strlen(s->kern[i]) == len && !memcmp(s->kern[i], name, len))
            return 0;
    char **k = realloc(s->kern, (size_t)(s->nkern + 1) * sizeof(*k));
    if (!k)
        return -1;
    s->kern = k;
    char *c = strndup(name, len);
    if (!c)
        return -1;
    s->kern[s->nkern++] = c;
    return 0;
}

static int add_var(struct fg_image_syms *s, const char *name, size_t len, uint64_t size)
{
    for (int i = 0; i < s->nvars; i++)
        if (strlen(s->vars[i].name) == len && !memcmp(s->vars[i].name, name, len)) {
            if (size > s->vars[i].size)
                s->vars[i].size = size;
            return 0;
        }
    struct fg_image_var *v = realloc(s->vars, (size_t)(s->nvars + 1) * sizeof(*v));
    if (!v)
        return -1;
    s->vars = v;
    char *c = strndup(name, len);
    if (!c)
        return -1;
    s->vars[s->nvars].name = c;
    s->vars[s->nvars].size = size ? size : 1;
    s->nvars++;
    return 0;
}

void fg_image_free(struct fg_image_syms *s)
{
    for (int i = 0; i < s->nkern; i++)
        free(s->kern[i]);
    for (int i = 0; i < s->nvars; i++)
        free(s->vars[i].name);
    free(s->kern);
    free(s->vars);
    memset(s, 0, sizeof(*s));
}

/* --- ELF64 (cubin) -------------------------------------------------------------------------- */

struct elf_sh {
    uint32_t name, type;
    uint64_t flags, addr, offset, size;
    uint32_t link, info;
    uint64_t align, entsize;
};

static int rd(const unsigned char *p, size_t len, uint64_t off, void *out, size_t n)
{
    if (off > len || n > len - off)
        return -1;
    memcpy(out, p + off, n);
    return 0;
}

/* len: the bytes available (0 = unknown: bounded by the section table's extent). */
static int parse_elf(const unsigned char *p, size_t len, struct fg_image_syms *s)
{
    if (p[4] != 2 || p[5] != 1) /* ELFCLASS64, little endian */
        return -1;
    uint64_t shoff;
    uint16_t shentsize, shnum, shstrndx;
    memcpy(&shoff, p + 0x28, 8);
    memcpy(&shentsize, p + 0x3a, 2);
    memcpy(&shnum, p + 0x3c, 2);
    memcpy(&shstrndx, p + 0x3e, 2);
    if (shentsize != 64 || shnum == 0 || shstrndx >= shnum)
        return -1;
    uint64_t end = shoff + (uint64_t)shnum * 64;
    if (!len) {
        /* unknown length: the section table and every section lie before MAX_IMAGE */
        if (end > MAX_IMAGE)
            return -1;
        len = (size_t)end;
        for (unsigned i = 0; i < shnum; i++) {
            struct elf_sh sh;
            memcpy(&sh, p + shoff + (uint64_t)i * 64, sizeof(sh));
            if (sh.type != 8 && sh.offset + sh.size > len && sh.offset + sh.size <= MAX_IMAGE) /* not NOBITS */
                len = (size_t)(sh.offset + sh.size);
        }
    }
    if (end > len)
        return -1;
    struct elf_sh *sh = calloc(shnum, sizeof(*sh));
    if (!sh)
        return -1;
    for (unsigned i = 0; i < shnum; i++)
        memcpy(&sh[i], p + shoff + (uint64_t)i * 64, sizeof(sh[i]));
    const struct elf_sh *shstr = &sh[shstrndx];
    int rc = 0;
    for (unsigned i = 0; i < shnum && rc == 0; i++) {
        if (sh[i].type != 2 || sh[i].entsize != 24 || sh[i].link >= shnum) /* SHT_SYMTAB */
            continue;
        const struct elf_sh *str = &sh[sh[i].link];
        for (uint64_t o = 0; o + 24 <= sh[i].size && rc == 0; o += 24) {
            struct {
                uint32_t name;
                unsigned char info, other;
                uint16_t shndx;
                uint64_t value, size;
            } sym;
            if (rd(p, len, sh[i].offset + o, &sym, 24) != 0) {
                rc = -1;
                break;
            }
            if (sym.name >= str->size || str->offset + sym.name >= len)
                continue;
            const char *nm = (const char *)p + str->offset + sym.name;
            size_t nl = strnlen(nm, len - (str->offset + sym.name));
            if (nl == 0)
                continue;
            int type = sym.info & 0xf;
            if (type == 2 && (sym.other & 0x10)) { /* STT_FUNC, CUDA entry */
                rc = add_kernel(s, nm, nl);
            } else if (type == 1 && sym.shndx > 0 && sym.shndx < shnum) { /* STT_OBJECT in a section */
                uint64_t sn = sh[sym.shndx].name;
                if (sn >= shstr->size || shstr->offset + sn >= len)
                    continue;
                const char *secn = (const char *)p + shstr->offset + sn;
                if (!strncmp(secn, ".nv.global", 10) ||
                    (!strncmp(secn, ".nv.constant", 12) && secn[12] >= '1' && secn[12] <= '9'))
                    rc = add_var(s, nm, nl, sym.size);
            }
        }
    }
    free(sh);
    return rc;
}

/* --- PTX ------------------------------------------------------------------------------------ */

static int ident_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '$' ||
           c == '.' || c == '%';
}

static const char *skip_ws(const char *p, const char *e)
{
    for (;;) {
        while (p < e && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
            p++;
        if (p + 1 < e && p[0] == '/' && p[1] == '/') {
            while (p < e && *p != '\n')
                p++;
        } else if (p + 1 < e && p[0] == '/' && p[1] == '*') {
            p += 2;
            while (p + 1 < e && !(p[0] == '*' && p[1] == '/'))
                p++;
            p = p + 2 < e ? p + 2 : e;
        } else {
            return p;
        }
    }
}

static uint64_t ptx_type_size(const char *t, size_t n)
{
    if (n < 3 || t[0] != '.')
        return 0;
    char k = t[1];
    if (k != 'b' && k != 'u' && k != 's' && k != 'f')
        return 0;
    long bits = strtol(t + 2, NULL, 10);
    return bits >= 8 ? (uint64_t)bits / 8 : 0;
}

/* A top-level `.global`/`.const` statement [start, end) (without the ';'). */
static int ptx_var(const char *st, const char *end, struct fg_image_syms *s)
{
    uint64_t elem = 0;
    const char *p = st;
    int is_var = 0;
    while (p < end) {
        p = skip_ws(p, end);
        const char *t = p;
        while (p < end && ident_char(*p))
            p++;
        size_t n = (size_t)(p - t);
        if (n == 0)
            return 0;
        if ((n == 7 && !memcmp(t, ".extern", 7)))
            return 0; /* a declaration: no storage in this module */
        if ((n == 7 && !memcmp(t, ".global", 7)) || (n == 6 && !memcmp(t, ".const", 6))) {
            is_var = 1;
            continue;
        }
        if (!is_var)
            continue; /* directives before it (.version, .target, .visible, ...) end without ';' */
        if (n == 6 && !memcmp(t, ".align", 6)) {
            p = skip_ws(p, end);
            while (p < end && ident_char(*p))
                p++;
            continue;
        }
        if (t[0] == '.') {
            uint64_t z = ptx_type_size(t, n);
            if (z)
                elem = z;
            continue;
        }
        if (!is_var || !elem)
            return 0;
        uint64_t count = 1;
        const char *q = skip_ws(p, end);
        while (q < end && *q == '[') {
            uint64_t d = strtoull(q + 1, NULL, 10);
            count *= d ? d : 1;
            while (q < end && *q != ']')
                q++;
            q = skip_ws(q + 1 < end ? q + 1 : end, end);
        }
        return add_var(s, t, n, elem * count);
    }
    return 0;
}

static int parse_ptx(const char *p, size_t len, struct fg_image_syms *s)
{
    const char *e = p + len;
    int depth = 0;
    const char *stmt = NULL;
    while (p < e) {
        p = skip_ws(p, e);
        if (p >= e)
            break;
        char c = *p;
        if (c == '"') {
            for (p++; p < e && *p != '"'; p++)
                ;
            p++;
            continue;
        }
        if (c == '{') {
            depth++;
            p++;
            stmt = NULL;
            continue;
        }
        if (c == '}') {
            depth = depth > 0 ? depth - 1 : 0;
            p++;
            stmt = NULL;
            continue;
        }
        if (c == ';') {
            if (depth == 0 && stmt && ptx_var(stmt, p, s) != 0)
                return -1;
            stmt = NULL;
            p++;
            continue;
        }
        if (!stmt)
            stmt = p;
        const char *t = p;
        while (p < e && ident_char(*p))
            p++;
        if (p == t) {
            p++;
            continue;
        }
        if (depth == 0 && p - t == 6 && !memcmp(t, ".entry", 6)) {
            const char *q = skip_ws(p, e);
            const char *n = q;
            while (q < e && ident_char(*q))
                q++;
            if (q > n && add_kernel(s, n, (size_t)(q - n)) != 0)
                return -1;
            p = q;
        }
    }
    return 0;
}

/* --- LZ4 block format (lz4/lz4 doc/lz4_Block_format.md) --------------------------------------- */

static long lz4_block(const unsigned char *src, size_t n, unsigned char *dst, size_t cap)
{
    size_t i = 0, o = 0;
    while (i < n) {
        unsigned tok = src[i++];
        size_t lit = tok >> 4;
        if (lit == 15) {
            unsigned char b;
            do {
                if (i >= n)
                    return -1;
                b = src[i++];
                lit += b;
            } while (b == 255);
        }
        if (lit > n - i || lit > cap - o)
            return -1;
        memcpy(dst + o, src + i, lit);
        i += lit;
        o += lit;
        if (i == n)
            break; /* the last sequence has literals only */
        if (n - i < 2)
            return -1;
        size_t off = (size_t)src[i] | ((size_t)src[i + 1] << 8);
        i += 2;
        if (off == 0 || off > o)
            return -1;
        size_t ml = tok & 15;
        if (ml == 15) {
            unsigned char b;
            do {
                if (i >= n)
                    return -1;
                b = src[i++];
                ml += b;
            } while (b == 255);
        }
        ml += 4;
        if (ml > cap - o)
            return -1;
        for (size_t k = 0; k < ml; k++, o++) /* overlapping copies repeat the pattern */
            dst[o] = dst[o - off];
    }
    return (long)o;
}

typedef size_t (*zstd_decompress_fn)(void *, size_t, const void *, size_t);
typedef unsigned (*zstd_iserror_fn)(size_t);

static int zstd_load(zstd_decompress_fn *dec, zstd_iserror_fn *iserr)
{
    static void *h;
    static int tried;
    if (!tried) {
        tried = 1;
        h = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    }
    if (!h)
        return -1;
    *dec = (zstd_decompress_fn)(uintptr_t)dlsym(h, "ZSTD_decompress");
    *iserr = (zstd_iserror_fn)(uintptr_t)dlsym(h, "ZSTD_isError");
    return *dec && *iserr ? 0 : -1;
}

/* --- fatbin container ----------------------------------------------------------------------- */

static int parse_entry(const unsigned char *e, size_t avail, struct fg_image_syms *s)
{
    uint16_t kind;
    uint32_t hsize, psize, csize;
    uint64_t flags, usize;
    memcpy(&kind, e, 2);
    memcpy(&hsize, e + 4, 4);
    memcpy(&psize, e + 8, 4);
    memcpy(&csize, e + 16, 4);
    if (hsize < 64 || hsize > avail)
        return -1;
    memcpy(&flags, e + 40, 8);
    memcpy(&usize, e + 56, 8);
    const unsigned char *pl = e + hsize;
    size_t plen = (flags & 0xa000) ? csize : psize;
    if (plen > avail - hsize)
        return -1;
    if (kind != 1 && kind != 2)
        return 0; /* other payloads (e.g. NVVM IR) name nothing we look up */
    unsigned char *buf = NULL;
    if (flags & 0xa000) {
        if (usize == 0 || usize > MAX_IMAGE)
            return -1;
        buf = malloc((size_t)usize + 1);
        if (!buf)
            return -1;
        long got = -1;
        if (flags & 0x2000) {
            got = lz4_block(pl, plen, buf, (size_t)usize);
        } else {
            zstd_decompress_fn dec;
            zstd_iserror_fn iserr;
            if (zstd_load(&dec, &iserr) != 0) {
                free(buf);
                s->opaque = 1;
                fg_trace("module image: a zstd-compressed entry and no libzstd.so.1: names taken as asked");
                return 0;
            }
            size_t r = dec(buf, (size_t)usize, pl, plen);
            got = iserr(r) ? -1 : (long)r;
        }
        if (got < 0) {
            free(buf);
            return -1;
        }
        pl = buf;
        plen = (size_t)got;
        buf[plen] = 0;
    }
    int rc;
    if (kind == 2)
        rc = plen >= 64 && !memcmp(pl, "\x7f" "ELF", 4) ? parse_elf(pl, plen, s) : -1;
    else
        rc = parse_ptx((const char *)pl, strnlen((const char *)pl, plen), s);
    free(buf);
    return rc;
}

static int parse_fatbin(const unsigned char *p, struct fg_image_syms *s)
{
    uint32_t magic;
    uint16_t version, hsize;
    uint64_t size;
    memcpy(&magic, p, 4);
    memcpy(&version, p + 4, 2);
    memcpy(&hsize, p + 6, 2);
    memcpy(&size, p + 8, 8);
    if (magic != FATBIN_MAGIC || version != 1 || hsize < 16 || size > MAX_IMAGE)
        return -1;
    const unsigned char *e = p + hsize, *end = e + size;
    int entries = 0;
    while ((size_t)(end - e) >= 64) {
        uint32_t eh, ps, cs;
        memcpy(&eh, e + 4, 4);
        memcpy(&ps, e + 8, 4);
        memcpy(&cs, e + 16, 4);
        if (parse_entry(e, (size_t)(end - e), s) != 0)
            return -1;
        entries++;
        uint64_t step = (uint64_t)eh + (ps > cs ? ps : cs);
        if (step == 0 || step > (uint64_t)(end - e))
            break;
        e += step;
    }
    return entries ? 0 : -1;
}

int fg_image_parse(const void *image, struct fg_image_syms *s)
{
    memset(s, 0, sizeof(*s));
    const unsigned char *p = image;
    uint32_t magic;
    memcpy(&magic, p, 4);
    int rc;
    if (magic == WRAPPER_MAGIC) {
        uint32_t version;
        const void *data, *list;
        memcpy(&version, p + 4, 4);
        memcpy(&data, p + 8, sizeof(data));
        memcpy(&list, p + 16, sizeof(list));
        if (version == 1 && data) {
            rc = parse_fatbin(data, s);
        } else if (version == 2 && list) {
            const void *const *fb = list;
            rc = 0;
            for (int i = 0; fb[i] && rc == 0 && i < 4096; i++)
                rc = parse_fatbin(fb[i], s);
        } else {
            rc = -1;
        }
    } else if (magic == FATBIN_MAGIC) {
        rc = parse_fatbin(p, s);
    } else if (!memcmp(p, "\x7f" "ELF", 4)) {
        rc = parse_elf(p, 0, s);
    } else {
        /* PTX is NUL-terminated text */
        size_t n = strnlen((const char *)p, MAX_IMAGE);
        rc = (n > 0 && n < MAX_IMAGE) ? parse_ptx((const char *)p, n, s) : -1;
        if (rc == 0 && s->nkern == 0 && s->nvars == 0 && !strstr((const char *)p, ".version"))
            rc = -1; /* not PTX */
    }
    if (rc != 0)
        fg_image_free(s);
    return rc;
}
