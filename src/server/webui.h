// The chat page served at GET / (src/server/webui/index.html: HTML, CSS and JS in one file). CMake compiles
// it into the binary as a raw string literal (webui_page.cpp.in), regenerated whenever the page changes.
#pragma once
#include <string_view>

namespace tansy {

std::string_view webui_index_html();

}  // namespace tansy
