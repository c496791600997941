// Scratch: LD_PRELOAD this to get a native backtrace when a process dies of SIGSEGV/SIGBUS.
//   gcc -shared -fPIC -O0 -g scripts/gpu_scratch_segv.c -o /tmp/segv.so
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_signal(int sig, siginfo_t* si, void* uc) {
  (void)uc;
  char msg[128];
  int len = snprintf(msg, sizeof msg, "\n*** signal %d at address %p, native backtrace:\n", sig, si->si_addr);
  write(2, msg, len);
  void* frames[64];
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  _exit(128 + sig);
}

__attribute__((constructor)) static void install(void) {
  static char stack[1 << 16];
  stack_t ss = {.ss_sp = stack, .ss_size = sizeof stack, .ss_flags = 0};
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGILL, &sa, NULL);
  sigaction(SIGFPE, &sa, NULL);
}
