// Decode timeline (timeline.cuh), what the backend calls: start recording if TANSY_TIMELINE names a file (a
// build without -DTANSY_TIMELINE=ON only says it has none), mark the launch list (a graph capture), write it all
// at the end.
#pragma once

namespace tansy::cuda {

void timeline_start();
void timeline_mark(const char* marker);
void timeline_stop();

}  // namespace tansy::cuda
