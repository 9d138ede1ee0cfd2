#include "cli/commands.h"

namespace reshard::cli {

// Not implemented yet: an empty Command is not registered.
Command bench_command() { return {}; }

}  // namespace reshard::cli
