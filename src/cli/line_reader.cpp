#include "cli/line_reader.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#ifdef TANSY_HAVE_LIBEDIT
#include <editline/readline.h>
#endif

namespace tansy {

namespace {
volatile sig_atomic_t g_interrupted = 0;
void on_interrupt(int) { g_interrupted = 1; }
}  // namespace

void install_interrupt_handler() {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_interrupt;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
#ifdef TANSY_HAVE_LIBEDIT
    rl_catch_signals = 0;  // libedit leaves SIGINT to us: readline() returns nullptr with the flag set
#endif
}

bool interrupted() { return g_interrupted != 0; }
void clear_interrupt() { g_interrupted = 0; }

bool line_reader::editing_available() {
#ifdef TANSY_HAVE_LIBEDIT
    return true;
#else
    return false;
#endif
}

line_reader::line_reader(bool terminal) : edit_(terminal && editing_available()) {}

line_reader::status line_reader::read(const char* prompt, std::string& out) {
    out.clear();
#ifdef TANSY_HAVE_LIBEDIT
    if (edit_) {
        char* l = readline(prompt);
        if (!l) return interrupted() ? status::interrupt : status::end;
        out = l;
        free(l);
        return status::line;
    }
#endif
    fputs(prompt, stdout);
    fflush(stdout);
    for (;;) {
        const int c = fgetc(stdin);
        if (c == EOF) {
            if (ferror(stdin) && errno == EINTR && interrupted()) {
                clearerr(stdin);
                return status::interrupt;
            }
            return out.empty() ? status::end : status::line;
        }
        if (c == '\n') return status::line;
        out += (char)c;
    }
}

void line_reader::remember(const std::string& line) {
#ifdef TANSY_HAVE_LIBEDIT
    if (edit_ && !line.empty()) add_history(line.c_str());
#else
    (void)line;
#endif
}

}  // namespace tansy
