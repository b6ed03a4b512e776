// The fedmesh command line for tests of private mode: the same commands as
// the shipped binary, plus two flags it does not have, taken out of argv
// wherever they appear:
//   --secure-exit-at ROUND:PHASE[,...]  a site dies with SIGKILL on reaching
//                                       that secure-aggregation phase of that round
//   --secure-dump DIR                   a site writes each round's fixed-point
//                                       input, before masking, to DIR/SITE-round-R.u32
#include <cstdio>
#include <string>
#include <vector>

#include "cli/app.h"

int main(int argc, char** argv) {
  fedmesh::node::SecureUploadFaults faults;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--secure-exit-at" || arg == "--secure-dump") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "fedmesh (test build): %s needs a value\n", arg.c_str());
        return 2;
      }
      (arg == "--secure-exit-at" ? faults.exit_at : faults.dump_dir) = argv[++i];
      continue;
    }
    rest.push_back(argv[i]);
  }
  rest.push_back(nullptr);
  return fedmesh::cli::run_fedmesh(static_cast<int>(rest.size()) - 1, rest.data(), faults);
}
