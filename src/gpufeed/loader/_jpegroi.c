/*
 * gpufeed.loader._jpegroi: decode one rectangle of a JPEG with libjpeg-turbo's scanline crop and skip
 * (jpeg_crop_scanline, jpeg_skip_scanlines), through the libjpeg-turbo that Pillow already loaded.
 *
 * Nothing of libjpeg is linked in: open(path) dlopen()s the library Python found (the one PIL._imaging uses) and
 * looks up the nine libjpeg API functions this file calls. The library checks the API version and the size of
 * the decompress struct it is handed (jpeg_CreateDecompress), so a library built for another API refuses here
 * instead of reading a struct of another layout; Python then runs a self-test decode before using it.
 *
 * decode_region(data, out, left, top, right, bottom, scale=1)
 *   Decodes the box [left, right) x [top, bottom) of the JPEG in `data` as RGB into `out`, contiguous
 *   ([bottom - top, right - left, 3] uint8). libjpeg decodes the box's columns widened to whole iMCUs into scratch
 *   rows, and the box's columns are copied out. With scale 2, 4 or 8 the image is decoded at 1/scale of its size
 *   (libjpeg's DCT scaling: ceil(width / scale) x ceil(height / scale) pixels) and the box is in those pixels. Rows
 *   above `top` are entropy-decoded only; rows below `bottom` are never read. Any libjpeg error or warning
 *   (corrupt or truncated data) raises ValueError with libjpeg's message, and nothing is printed. The GIL is
 *   released while decoding. Every size is checked before a byte is written: the box against the image, the box
 *   against `out`'s length.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#ifndef _WIN32
#include <dlfcn.h>
#endif

#include "_jpeg/jpeglib.h"

#define MAX_ROWS_PER_READ 16
#define MIN_CROP_COLUMNS 4

static struct {
    void *handle;
    struct jpeg_error_mgr *(*std_error)(struct jpeg_error_mgr *);
    void (*create)(j_decompress_ptr, int, size_t);
    void (*destroy)(j_decompress_ptr);
    void (*mem_src)(j_decompress_ptr, const unsigned char *, unsigned long);
    int (*read_header)(j_decompress_ptr, boolean);
    boolean (*start)(j_decompress_ptr);
    void (*crop)(j_decompress_ptr, JDIMENSION *, JDIMENSION *);
    JDIMENSION (*skip)(j_decompress_ptr, JDIMENSION);
    JDIMENSION (*read)(j_decompress_ptr, JSAMPARRAY, JDIMENSION);
} lib;

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} error_mgr;

static void on_error(j_common_ptr cinfo)
{
    error_mgr *err = (error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level)
{
    /* level < 0: a warning (corrupt data, a premature end): as strict as simplejpeg, a warning is a failure */
    if (level < 0)
        on_error(cinfo);
}

static void on_output(j_common_ptr cinfo)
{
    (void)cinfo; /* nothing on stderr: the caller says what failed, in one sentence */
}

static PyObject *jpegroi_open(PyObject *self, PyObject *args)
{
    const char *path;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
#ifdef _WIN32
    PyErr_SetString(PyExc_OSError, "no dlopen on this platform");
    return NULL;
#else
    if (lib.handle != NULL)
        Py_RETURN_NONE;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        PyErr_Format(PyExc_OSError, "cannot load %s: %s", path, dlerror());
        return NULL;
    }
#define FIND(field, name)                                                                     \
    do {                                                                                      \
        *(void **)(&lib.field) = dlsym(h, name);                                              \
        if (lib.field == NULL) {                                                              \
            dlclose(h);                                                                       \
            memset(&lib, 0, sizeof(lib));                                                     \
            PyErr_Format(PyExc_OSError, "%s has no %s (not libjpeg-turbo's libjpeg API)", path, name); \
            return NULL;                                                                      \
        }                                                                                     \
    } while (0)
    FIND(std_error, "jpeg_std_error");
    FIND(create, "jpeg_CreateDecompress");
    FIND(destroy, "jpeg_destroy_decompress");
    FIND(mem_src, "jpeg_mem_src");
    FIND(read_header, "jpeg_read_header");
    FIND(start, "jpeg_start_decompress");
    FIND(crop, "jpeg_crop_scanline");
    FIND(skip, "jpeg_skip_scanlines");
    FIND(read, "jpeg_read_scanlines");
#undef FIND
    lib.handle = h;
    Py_RETURN_NONE;
#endif
}

/* The decode itself, without the GIL. Returns NULL on success, else the reason (in err->message or static). */
static const char *decode(error_mgr *err, const unsigned char *data, size_t size, unsigned char *out,
                          Py_ssize_t out_len, JDIMENSION left, JDIMENSION top, JDIMENSION right, JDIMENSION bottom,
                          unsigned int scale)
{
    struct jpeg_decompress_struct cinfo;
    const char *volatile failure = NULL;
    volatile int created = 0;
    unsigned char *volatile scratch = NULL;

    memset(&cinfo, 0, sizeof(cinfo));
    cinfo.err = lib.std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->pub.output_message = on_output;
    err->message[0] = '\0';
    if (setjmp(err->jump)) {
        failure = err->message[0] ? err->message : "libjpeg failed";
        goto done;
    }
    lib.create(&cinfo, JPEG_LIB_VERSION, sizeof(cinfo));
    created = 1;
    lib.mem_src(&cinfo, data, (unsigned long)size);
    if (lib.read_header(&cinfo, TRUE) != JPEG_HEADER_OK) {
        failure = "no image in the data";
        goto done;
    }
    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
        cinfo.jpeg_color_space != JCS_RGB) {
        failure = "not a YCbCr, grey or RGB JPEG";
        goto done;
    }
    /* the output size libjpeg will use at 1/scale, checked before it allocates anything for it */
    JDIMENSION out_w = (cinfo.image_width + scale - 1) / scale, out_h = (cinfo.image_height + scale - 1) / scale;
    if (right > out_w || bottom > out_h) {
        failure = "the box lies outside the image";
        goto done;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    cinfo.scale_num = 1;
    cinfo.scale_denom = scale;
    lib.start(&cinfo);
    if (cinfo.output_components != 3 || cinfo.output_width != out_w || cinfo.output_height != out_h) {
        failure = "unexpected output shape";
        goto done;
    }
    /* one column more on each side than asked (where the image has one), and at least 4 columns: the crop's edge
       columns then get their chroma neighbours (a crop of one chroma column is upsampled by replication, not the
       fancy filter), and the box's pixels are those of a whole-image decode, bit for bit */
    JDIMENSION x0 = left > 0 ? left - 1 : 0;
    JDIMENSION width = (right < out_w ? right + 1 : right) - x0;
    if (width < MIN_CROP_COLUMNS)
        width = out_w - x0 < MIN_CROP_COLUMNS ? out_w - x0 : MIN_CROP_COLUMNS;
    lib.crop(&cinfo, &x0, &width);
    /* the caller checked the box against out's length; the widened columns must hold the box, and libjpeg writes
       output_width pixels per row (jpeg_crop_scanline sets it to the widened width) */
    size_t box_bytes = (size_t)(right - left) * 3, row_bytes = (size_t)cinfo.output_width * 3;
    if (x0 > left || x0 + width < right || cinfo.output_width != width ||
        (Py_ssize_t)(box_bytes * (bottom - top)) > out_len) {
        failure = "the box does not fit the decoded columns";
        goto done;
    }
    /* libjpeg writes whole widened rows into the scratch rows; the box's columns are copied out, row after row */
    scratch = malloc(MAX_ROWS_PER_READ * row_bytes);
    if (scratch == NULL) {
        failure = "out of memory";
        goto done;
    }
    if (top > 0 && lib.skip(&cinfo, top) != top) {
        failure = "could not skip to the box's first row";
        goto done;
    }
    const unsigned char *from = scratch + (size_t)(left - x0) * 3;
    /* each read returns at least one row (an in-memory source never suspends): at most bottom - top reads */
    for (JDIMENSION reads = 0; cinfo.output_scanline < bottom && reads < bottom - top; reads++) {
        JSAMPROW scan[MAX_ROWS_PER_READ];
        JDIMENSION first = cinfo.output_scanline - top, n = bottom - cinfo.output_scanline;
        if (n > MAX_ROWS_PER_READ)
            n = MAX_ROWS_PER_READ;
        for (JDIMENSION i = 0; i < n; i++)
            scan[i] = scratch + i * row_bytes;
        JDIMENSION got = lib.read(&cinfo, scan, n);
        if (got == 0 || got > n) {
            failure = "libjpeg returned no rows";
            goto done;
        }
        for (JDIMENSION i = 0; i < got; i++)
            memcpy(out + (size_t)(first + i) * box_bytes, from + i * row_bytes, box_bytes);
    }
    if (cinfo.output_scanline < bottom) {
        failure = "libjpeg returned too few rows";
        goto done;
    }
done:
    free(scratch);
    if (created) {
        if (setjmp(err->jump) == 0) /* abort/destroy do not fail; guarded all the same */
            lib.destroy(&cinfo);
    }
    return failure;
}

static PyObject *jpegroi_decode_region(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"data", "out", "left", "top", "right", "bottom", "scale", NULL};
    Py_buffer src, dst;
    int left, top, right, bottom, scale = 1;
    (void)self;
    if (lib.handle == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no libjpeg loaded (call open first)");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*w*iiii|i", keywords, &src, &dst, &left, &top, &right, &bottom,
                                     &scale))
        return NULL;
    PyObject *result = NULL;
    if (left < 0 || top < 0 || left >= right || top >= bottom || !PyBuffer_IsContiguous(&dst, 'C')) {
        PyErr_SetString(PyExc_ValueError, "a negative or empty box, or a non-contiguous buffer");
        goto out;
    }
    if (scale != 1 && scale != 2 && scale != 4 && scale != 8) {
        PyErr_SetString(PyExc_ValueError, "scale must be 1, 2, 4 or 8");
        goto out;
    }
    /* the box against out's length before any decoding, with no product that could overflow: rows by division */
    Py_ssize_t box_bytes = (Py_ssize_t)(right - left) * 3;
    if (box_bytes > dst.len || (Py_ssize_t)(bottom - top) > dst.len / box_bytes) {
        PyErr_SetString(PyExc_ValueError, "the box does not fit the buffer");
        goto out;
    }
    error_mgr err;
    const char *failure;
    Py_BEGIN_ALLOW_THREADS
    failure = decode(&err, (const unsigned char *)src.buf, (size_t)src.len, (unsigned char *)dst.buf, dst.len,
                     (JDIMENSION)left, (JDIMENSION)top, (JDIMENSION)right, (JDIMENSION)bottom, (unsigned int)scale);
    Py_END_ALLOW_THREADS
    if (failure != NULL)
        PyErr_SetString(PyExc_ValueError, failure);
    else
    {
        Py_INCREF(Py_None);
        result = Py_None;
    }
out:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"open", jpegroi_open, METH_VARARGS, "open(path): load libjpeg-turbo's libjpeg API from this shared library."},
    {"decode_region", (PyCFunction)(void (*)(void))jpegroi_decode_region, METH_VARARGS | METH_KEYWORDS,
     "decode_region(data, out, left, top, right, bottom, scale=1): the RGB pixels of the box of the image at "
     "1/scale into out, contiguous [bottom - top, right - left, 3]; ValueError on any libjpeg error or warning."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegroi", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__jpegroi(void)
{
    return PyModule_Create(&module);
}
