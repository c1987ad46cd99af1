# What setup.py tells each extension of its build: the digest of the .pyx it was built
# from, compared in a source checkout with the .pyx there (see thing/_core/__init__.py).
cdef extern from *:
    """
    #ifndef THING_SOURCE_DIGEST
    #define THING_SOURCE_DIGEST ""
    #endif
    """
    const char *THING_SOURCE_DIGEST
