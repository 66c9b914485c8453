/*
 * bench.py's first prestart hook for the "real host" cases: it gives the container the
 * /proc/driver/nvidia a host with the NVIDIA kernel module has, by binding a fixture host's
 * proc/driver onto the container's /proc/driver inside the container's mount namespace.
 * runc refuses a config.json mount inside /proc, hence a hook. NVIDIA's
 * nvidia-container-cli needs that directory (it fails without it); nvhook emulates it
 * when it is missing, and takes the real-host path when it is there.
 *
 *     procdriver-hook SRC ROOTFS [TARGET]   (OCI state on stdin; only its "pid" is read)
 *
 * binds SRC onto ROOTFS/TARGET (default TARGET: /proc/driver).
 *
 * Built by bench.py with gcc; a C program so that its own cost (one fork/exec, a setns and
 * a mount) stays small next to what is measured, and is subtracted anyway: the baseline of
 * those cases is a container with this hook alone.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    static char state[1 << 16];
    char path[4096];
    size_t n;
    const char *p;
    long pid;
    int fd;

    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: %s SRC ROOTFS [TARGET] < state.json\n", argv[0]);
        return 2;
    }
    n = fread(state, 1, sizeof(state) - 1, stdin);
    state[n] = '\0';
    p = strstr(state, "\"pid\"");
    if (p == NULL || (p = strchr(p, ':')) == NULL || (pid = strtol(p + 1, NULL, 10)) <= 0) {
        fprintf(stderr, "procdriver-hook: no pid in the OCI state\n");
        return 1;
    }
    snprintf(path, sizeof(path), "/proc/%ld/ns/mnt", pid);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || setns(fd, CLONE_NEWNS) < 0) {
        perror("procdriver-hook: setns");
        return 1;
    }
    snprintf(path, sizeof(path), "%s%s", argv[2], argc == 4 ? argv[3] : "/proc/driver");
    if (mount(argv[1], path, NULL, MS_BIND | MS_REC, NULL) < 0) {
        perror("procdriver-hook: mount");
        return 1;
    }
    return 0;
}
