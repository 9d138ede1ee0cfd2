// The pure pieces of the native format that its metadata parser shares with the writer: rank
// file names and the streaming xxh3-64 behind the layout digest. No I/O, so the metadata fuzz
// target (tests/fuzz) links them without the writer.
#include <xxhash.h>
#if RESHARD_HAVE_XXH_DISPATCH
#include <xxh_x86dispatch.h>  // same hash values, the widest vector unit the CPU has
#endif

#include <cstdio>
#include <new>

#include "formats/native/native_internal.h"

namespace reshard::native {

std::string rank_file_name(int rank) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank_%05d.safetensors", rank);
  return buf;
}

Xxh3Stream::Xxh3Stream() : state_(XXH3_createState()) {
  if (!state_) throw std::bad_alloc();
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}

Xxh3Stream::~Xxh3Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

void Xxh3Stream::update(const void* data, size_t bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, bytes);
}

std::string Xxh3Stream::hex() const {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)));
  return buf;
}

}  // namespace reshard::native
