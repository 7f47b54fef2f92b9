// Interactive line input for `tansy run --chat`: line editing and history from libedit (Debian's libedit-dev)
// when tansy is built with it and stdin is a terminal, plain reads otherwise. Ctrl-C is the caller's business:
// install_interrupt_handler() turns SIGINT into a flag that read() reports and a running answer polls.
#pragma once
#include <string>

namespace tansy {

// SIGINT sets the flag instead of ending the process (no SA_RESTART: a blocked read returns).
void install_interrupt_handler();
bool interrupted();        // a SIGINT came since the last clear_interrupt()
void clear_interrupt();

class line_reader {
  public:
    explicit line_reader(bool terminal);
    enum class status { line, interrupt, end };  // a line; Ctrl-C at the prompt (the typed text is dropped); EOF
    status read(const char* prompt, std::string& out);
    void remember(const std::string& line);  // into the history (arrow up)
    static bool editing_available();         // built with libedit

  private:
    bool edit_;
};

}  // namespace tansy
