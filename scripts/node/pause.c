/*
 * The sandbox process of a pod: it holds the pod's namespaces open, reaps the zombies it inherits
 * as PID 1 of a shared PID namespace, and exits cleanly on SIGINT or SIGTERM.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int signo) {
  (void)signo;
  _exit(0);
}

static void reap(int signo) {
  (void)signo;
  int saved = errno;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
  errno = saved;
}

static int on(int signo, void (*handler)(int), int flags) {
  struct sigaction action;
  memset(&action, 0, sizeof(action));
  action.sa_handler = handler;
  action.sa_flags = flags;
  sigemptyset(&action.sa_mask);
  return sigaction(signo, &action, NULL);
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("pause (diloco)");
    return 0;
  }
  if (getpid() != 1) {
    fputs("warning: pause should be the first process of its PID namespace\n", stderr);
  }
  if (on(SIGINT, stop, 0) < 0 || on(SIGTERM, stop, 0) < 0 || on(SIGCHLD, reap, SA_NOCLDSTOP) < 0) {
    perror("sigaction");
    return 1;
  }
  for (;;) {
    pause();
  }
}
