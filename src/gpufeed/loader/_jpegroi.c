/*
 * gpufeed.loader._jpegroi: decode one rectangle of a JPEG with libjpeg-turbo's scanline crop and skip
 * (jpeg_crop_scanline, jpeg_skip_scanlines), through the libjpeg-turbo that Pillow already loaded.
 *
 * Nothing of libjpeg is linked in: open(path) dlopen()s the library Python found (the one PIL._imaging uses) and
 * looks up the eleven libjpeg API functions this file calls. The library checks the API version and the size of
 * the decompress struct it is handed (jpeg_CreateDecompress), so a library built for another API refuses here
 * instead of reading a struct of another layout; Python then runs a self-test decode before using it.
 *
 * decode_region(data, out, stride, left, top, right, bottom) -> (x0, width)
 *   Decodes rows [top, bottom) of the JPEG in `data` as RGB into `out` (row r at out + r * stride), columns
 *   [x0, x0 + width), where x0 <= left and x0 + width >= right (libjpeg widens the crop to whole iMCUs). Rows
 *   above `top` are entropy-decoded only; rows below `bottom` are never read. Any libjpeg error or warning
 *   (corrupt or truncated data) raises ValueError with libjpeg's message, and nothing is printed. The GIL is
 *   released while decoding. Every size is checked before a byte is written: the box against the image, the row
 *   width against `stride`, the rows against `out`'s length.
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
    void (*abort_)(j_decompress_ptr);
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
    FIND(abort_, "jpeg_abort_decompress");
#undef FIND
    lib.handle = h;
    Py_RETURN_NONE;
#endif
}

/* The decode itself, without the GIL. Returns NULL on success, else the reason (in err->message or static). */
static const char *decode(error_mgr *err, const unsigned char *data, size_t size, unsigned char *out,
                          Py_ssize_t out_len, Py_ssize_t stride, JDIMENSION left, JDIMENSION top, JDIMENSION right,
                          JDIMENSION bottom, JDIMENSION *x0_out, JDIMENSION *width_out)
{
    struct jpeg_decompress_struct cinfo;
    const char *volatile failure = NULL;
    volatile int created = 0;

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
    if (right > cinfo.image_width || bottom > cinfo.image_height) {
        failure = "the box lies outside the image";
        goto done;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    lib.start(&cinfo);
    if (cinfo.output_components != 3 || cinfo.output_width != cinfo.image_width ||
        cinfo.output_height != cinfo.image_height) {
        failure = "unexpected output shape";
        goto done;
    }
    /* one column more on each side than asked (where the image has one), and at least 4 columns: the crop's edge
       columns then get their chroma neighbours (a crop of one chroma column is upsampled by replication, not the
       fancy filter), and the box's pixels are those of a whole-image decode, bit for bit */
    JDIMENSION x0 = left > 0 ? left - 1 : 0;
    JDIMENSION width = (right < cinfo.image_width ? right + 1 : right) - x0;
    if (width < MIN_CROP_COLUMNS)
        width = cinfo.image_width - x0 < MIN_CROP_COLUMNS ? cinfo.image_width - x0 : MIN_CROP_COLUMNS;
    lib.crop(&cinfo, &x0, &width);
    Py_ssize_t rows = (Py_ssize_t)(bottom - top), row_bytes = (Py_ssize_t)width * 3;
    /* no product that could overflow: the last row's start, (rows - 1) * stride, is compared by division */
    if (x0 > left || x0 + width < right || row_bytes > stride || row_bytes > out_len ||
        (rows > 1 && rows - 1 > (out_len - row_bytes) / stride)) {
        failure = "the decoded rows do not fit the buffer";
        goto done;
    }
    if (top > 0 && lib.skip(&cinfo, top) != top) {
        failure = "could not skip to the box's first row";
        goto done;
    }
    /* each read returns at least one row (an in-memory source never suspends): at most bottom - top reads */
    for (JDIMENSION reads = 0; cinfo.output_scanline < bottom && reads < bottom - top; reads++) {
        JSAMPROW rows[MAX_ROWS_PER_READ];
        JDIMENSION n = bottom - cinfo.output_scanline;
        if (n > MAX_ROWS_PER_READ)
            n = MAX_ROWS_PER_READ;
        for (JDIMENSION i = 0; i < n; i++)
            rows[i] = out + (Py_ssize_t)(cinfo.output_scanline - top + i) * stride;
        if (lib.read(&cinfo, rows, n) == 0) {
            failure = "libjpeg returned no rows";
            goto done;
        }
    }
    if (cinfo.output_scanline < bottom) {
        failure = "libjpeg returned too few rows";
        goto done;
    }
    *x0_out = x0;
    *width_out = width;
done:
    if (created) {
        if (setjmp(err->jump) == 0) /* abort/destroy do not fail; guarded all the same */
            lib.destroy(&cinfo);
    }
    return failure;
}

static PyObject *jpegroi_decode_region(PyObject *self, PyObject *args)
{
    Py_buffer src, dst;
    Py_ssize_t stride;
    int left, top, right, bottom;
    (void)self;
    if (lib.handle == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no libjpeg loaded (call open first)");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "y*w*niiii", &src, &dst, &stride, &left, &top, &right, &bottom))
        return NULL;
    PyObject *result = NULL;
    if (left < 0 || top < 0 || left >= right || top >= bottom || stride <= 0 || !PyBuffer_IsContiguous(&dst, 'C')) {
        PyErr_SetString(PyExc_ValueError, "a negative or empty box, a stride <= 0 or a non-contiguous buffer");
        goto out;
    }
    error_mgr err;
    JDIMENSION x0 = 0, width = 0;
    const char *failure;
    Py_BEGIN_ALLOW_THREADS
    failure = decode(&err, (const unsigned char *)src.buf, (size_t)src.len, (unsigned char *)dst.buf, dst.len,
                     stride, (JDIMENSION)left, (JDIMENSION)top, (JDIMENSION)right, (JDIMENSION)bottom, &x0, &width);
    Py_END_ALLOW_THREADS
    if (failure != NULL)
        PyErr_SetString(PyExc_ValueError, failure);
    else
        result = Py_BuildValue("(II)", (unsigned int)x0, (unsigned int)width);
out:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"open", jpegroi_open, METH_VARARGS, "open(path): load libjpeg-turbo's libjpeg API from this shared library."},
    {"decode_region", jpegroi_decode_region, METH_VARARGS,
     "decode_region(data, out, stride, left, top, right, bottom) -> (x0, width): RGB rows [top, bottom) of columns "
     "[x0, x0 + width) into out (row r at r * stride); ValueError on any libjpeg error or warning."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegroi", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__jpegroi(void)
{
    return PyModule_Create(&module);
}
