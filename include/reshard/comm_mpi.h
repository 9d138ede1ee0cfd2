// Factories for the MPI communicator that need no MPI header (MPI types stay out of include/).
// Implemented in library `reshard_mpi`, which defines RESHARD_HAVE_MPI=1 for its users; code that
// must also build without MPI should guard calls with `#ifdef RESHARD_HAVE_MPI` and fall back to
// make_local_communicator().
#pragma once

#include <memory>
#include <string>

#include "reshard/comm.h"

namespace reshard {

/// True when this process was started by an MPI launcher (mpirun/mpiexec/srun): the environment
/// has OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK.
bool mpi_launched();

/// The communicator of the whole job: when mpi_launched(), an MPI communicator over
/// MPI_COMM_WORLD (initialising MPI first if nobody has; MPI is then finalised at process exit);
/// otherwise make_local_communicator(). Collective over the job when launched under MPI.
std::unique_ptr<Communicator> make_world_communicator();

/// Ends the whole job after an error on one rank, so that no peer stays blocked in a collective:
/// prints `message` (if not empty) to stderr, then MPI_Abort(MPI_COMM_WORLD, exit_code) when MPI
/// is initialised and not finalised, else std::_Exit(exit_code).
[[noreturn]] void abort_world(int exit_code, const std::string& message);

}  // namespace reshard
