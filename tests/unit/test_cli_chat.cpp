// `tansy run --chat` as a person uses it, through a pseudo-terminal: arrow-up recalls the last line (libedit),
// Ctrl-C during an answer stops it and returns to the prompt, the next message is answered, Ctrl-D exits 0; and
// with stdout piped, stdout carries the answer alone (the reasoning goes to stderr).
#include <gtest/gtest.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "cli/line_reader.h"
#include "test_util.h"

namespace {

using clk = std::chrono::steady_clock;

// A child process on a pseudo-terminal.
class pty_child {
  public:
    explicit pty_child(const std::string& cmd) {
        pid_ = forkpty(&fd_, nullptr, nullptr, nullptr);
        if (pid_ == 0) {
            setenv("TERM", "xterm", 1);
            execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), (char*)nullptr);  // Ctrl-C reaches tansy alone
            _exit(127);
        }
    }
    ~pty_child() {
        if (pid_ > 0 && !reaped_) {
            kill(pid_, SIGKILL);
            waitpid(pid_, nullptr, 0);
        }
        if (fd_ >= 0) close(fd_);
    }
    bool ok() const { return pid_ > 0; }
    void send(const std::string& s) { ASSERT_EQ(write(fd_, s.data(), s.size()), (ssize_t)s.size()); }
    // Reads until the output so far ends with `until` (or contains it, with anywhere) or `seconds` pass.
    std::string read_until(const std::string& until, double seconds, bool anywhere = false) {
        const auto end = clk::now() + std::chrono::duration<double>(seconds);
        std::string out;
        while (clk::now() < end) {
            pollfd p{fd_, POLLIN, 0};
            if (poll(&p, 1, 50) <= 0) continue;
            char buf[4096];
            const ssize_t n = read(fd_, buf, sizeof buf);
            if (n <= 0) break;
            out.append(buf, (size_t)n);
            all_ += std::string(buf, (size_t)n);
            if (!until.empty() && (anywhere ? out.find(until) != std::string::npos
                                            : out.size() >= until.size() && out.compare(out.size() - until.size(), until.size(), until) == 0))
                break;
        }
        return out;
    }
    // Reads until the chat's prompt is shown and the output then stays quiet (an answer may itself contain "> ").
    std::string read_prompt(double seconds) {
        const auto end = clk::now() + std::chrono::duration<double>(seconds);
        std::string out;
        while (clk::now() < end) {
            out += read_until("\n> ", std::chrono::duration<double>(end - clk::now()).count());
            if (out.size() < 3 || out.compare(out.size() - 3, 3, "\n> ") != 0) continue;
            const std::string more = read_until("", 0.4);
            out += more;
            if (more.empty()) break;
        }
        return out;
    }
    // The exit status, or -1 if it has not exited within `seconds`.
    int wait_exit(double seconds) {
        const auto end = clk::now() + std::chrono::duration<double>(seconds);
        while (clk::now() < end) {
            int st = 0;
            if (waitpid(pid_, &st, WNOHANG) == pid_) {
                reaped_ = true;
                return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            }
            read_until("", 0.05);
        }
        return -1;
    }
    const std::string& transcript() const { return all_; }

  private:
    int fd_ = -1;
    pid_t pid_ = -1;
    bool reaped_ = false;
    std::string all_;
};

const std::string CLI = TANSY_CLI;
constexpr double k_answer_s = 120;  // an answer of the bundled model, generously (sanitizer builds are ~40x slower)

}  // namespace

TEST(cli_chat, line_editing_ctrl_c_and_exit_through_a_terminal) {
    if (!tansy::line_reader::editing_available()) GTEST_SKIP() << "built without libedit";
    pty_child c(CLI + " run --chat --no-think -n 400 --threads 1");
    ASSERT_TRUE(c.ok());
    ASSERT_NE(c.read_prompt(k_answer_s).find("> "), std::string::npos) << c.transcript();
    // an answer long enough to interrupt (the bundled model writes code for this one)
    c.send("What is 2+2?\r");
    c.read_until("2?\r\n", 10, true);     // the echo of the line
    c.read_until("", 0.3);                // the answer has begun (or the prompt is still being read)
    c.send("\x03");
    const std::string stopped = c.read_prompt(k_answer_s);
    EXPECT_NE(stopped.find("[stopped]"), std::string::npos) << c.transcript();
    // arrow up: the last line comes back for editing; Ctrl-U clears it
    c.send("\x1b[A");
    EXPECT_NE(c.read_until("2+2?", 5, true).find("What is 2+2?"), std::string::npos) << c.transcript();
    c.send("\x15Hello!\r");
    const std::string answer = c.read_prompt(k_answer_s);
    EXPECT_NE(answer.find("Hello!"), std::string::npos) << c.transcript();
    EXPECT_EQ(answer.find("[stopped]"), std::string::npos) << c.transcript();
    EXPECT_GT(answer.size(), std::string("Hello!\r\n> ").size() + 4) << "no answer: " << c.transcript();
    // Ctrl-C at the prompt warns; Ctrl-D exits with status 0
    c.send("\x03");
    EXPECT_NE(c.read_prompt(10).find("again"), std::string::npos) << c.transcript();
    c.send("\x04");
    EXPECT_EQ(c.wait_exit(30), 0) << c.transcript();
}

TEST(cli_chat, piped_output_carries_the_answer_alone) {
    std::string out, err;
    const std::string dir = tansy::test::temp_dir("chat-pipe");
    ASSERT_EQ(tansy::test::run_command("printf 'Hello!\\n/exit\\n' | " + CLI + " run --chat -n 96 --threads 1 2>" + dir +
                                           "/err",
                                       &out, false),
              0);
    ASSERT_EQ(tansy::test::run_command("cat " + dir + "/err", &err, false), 0);
    // the reasoning (the line after the banner on stderr) is not in stdout, and stdout has the answer
    const size_t a = err.find('\n');
    ASSERT_NE(a, std::string::npos) << err;
    const std::string reasoning = err.substr(a + 1, err.find('\n', a + 1) - a - 1);
    ASSERT_GT(reasoning.size(), 8u) << "the bundled model reasons first; stderr: " << err;
    EXPECT_EQ(out.find(reasoning), std::string::npos) << "reasoning on stdout:\n" << out;
    EXPECT_EQ(out.find("\033["), std::string::npos) << "terminal codes on a pipe";
    EXPECT_GT(out.size(), 4u) << out;
}
