/* The node's pod sandbox process (what registry.k8s.io/pause does): hold the pod's namespaces,
 * reap what is reparented to it, exit 0 on SIGINT/SIGTERM. Linked statically so that its image
 * is this one file. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, 0, WNOHANG) > 0) {
    }
}

int main(void) {
    signal(SIGINT, quit);
    signal(SIGTERM, quit);
    signal(SIGCHLD, reap);
    for (;;)
        pause();
}
