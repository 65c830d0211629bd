/* A disk that drops writes to the store's index: fsync and fdatasync of a file whose name
   ends in "-wal" fail with EIO while the file named by $SPARKCACHE_TEST_FAIL_FSYNC exists.
   Built by tests/test_index_fsync.py and preloaded (LD_PRELOAD) into a supervisor, so
   that SQLite's own fsync at a COMMIT fails as it would on a failing disk. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int failing(int fd) {
    const char *trigger = getenv("SPARKCACHE_TEST_FAIL_FSYNC");
    char link[64], path[4096];
    ssize_t n;
    if (trigger == NULL || access(trigger, F_OK) != 0)
        return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    n = readlink(link, path, sizeof path - 1);
    if (n < 4)
        return 0;
    path[n] = '\0';
    return strcmp(path + n - 4, "-wal") == 0;
}

/* The libc call named, unless the WAL's fsync is to fail. */
static int sync_or_fail(int fd, const char *name, int (**real)(int)) {
    if (failing(fd)) {
        errno = EIO;
        return -1;
    }
    if (*real == NULL)
        *real = (int (*)(int))dlsym(RTLD_NEXT, name);
    return (*real)(fd);
}

int fsync(int fd) {
    static int (*real)(int);
    return sync_or_fail(fd, "fsync", &real);
}

int fdatasync(int fd) {
    static int (*real)(int);
    return sync_or_fail(fd, "fdatasync", &real);
}
