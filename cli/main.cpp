// fedmesh: one binary for every role of a federation.
#include "cli/app.h"

int main(int argc, char** argv) { return fedmesh::cli::run_fedmesh(argc, argv); }
