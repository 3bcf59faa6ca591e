/* A link's cost on every MPI call that moves data: the benchmark's link emulator.
 *
 * Given to MLX as its MPI library (MLX_MPI_LIBNAME) and to mpi4py through
 * LD_PRELOAD, it defines the MPI calls that move data as "wait, then call
 * PMPI_...": every other symbol resolves to Open MPI through the library it
 * links. The wait is MLXDIST_LINK_LATENCY_US microseconds plus the call's
 * bytes over MLXDIST_LINK_GBPS gigabytes per second, charged once per call on
 * the rank that sends (MPI_Send, MPI_Isend) or on every rank taking part in a
 * collective (MPI_Allreduce, MPI_Allgather, MPI_Iallgather, MPI_Bcast, MPI_Ibcast), so a
 * ping-pong costs two latencies and an all-reduce one. Receives are free: the
 * sender's wait delays them. Long waits sleep (ranks may share cores) and
 * spin only for the last SPIN_NS, so the wait ends on time.
 */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdlib.h>
#include <time.h>

#define SPIN_NS 50000L

static double latency_ns = -1.0;
static double ns_per_byte = 0.0;

static void configure(void) {
  const char *latency = getenv("MLXDIST_LINK_LATENCY_US");
  const char *gbps = getenv("MLXDIST_LINK_GBPS");
  double rate = gbps ? atof(gbps) : 0.0;
  ns_per_byte = rate > 0.0 ? 1.0 / rate : 0.0; /* GB/s = bytes per ns */
  latency_ns = latency ? atof(latency) * 1e3 : 0.0;
}

static long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void charge(long long bytes) {
  if (latency_ns < 0.0) configure();
  long long wait = (long long)(latency_ns + (double)bytes * ns_per_byte);
  if (wait <= 0) return;
  long long end = now_ns() + wait;
  if (wait > SPIN_NS) {
    long long sleep = wait - SPIN_NS;
    struct timespec t = {sleep / 1000000000LL, sleep % 1000000000LL};
    nanosleep(&t, NULL);
  }
  while (now_ns() < end) {
  }
}

static long long bytes_of(int count, MPI_Datatype type) {
  int size = 0;
  PMPI_Type_size(type, &size);
  return (long long)count * size;
}

int MPI_Send(const void *buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm) {
  charge(bytes_of(count, type));
  return PMPI_Send(buf, count, type, dest, tag, comm);
}

int MPI_Isend(const void *buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm,
              MPI_Request *request) {
  charge(bytes_of(count, type));
  return PMPI_Isend(buf, count, type, dest, tag, comm, request);
}

int MPI_Allreduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
  charge(bytes_of(count, type));
  return PMPI_Allreduce(sendbuf, recvbuf, count, type, op, comm);
}

int MPI_Allgather(const void *sendbuf, int sendcount, MPI_Datatype sendtype, void *recvbuf, int recvcount,
                  MPI_Datatype recvtype, MPI_Comm comm) {
  int size = 1;
  PMPI_Comm_size(comm, &size);
  charge(bytes_of(recvcount, recvtype) * (size - 1)); /* what each rank receives */
  return PMPI_Allgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
}

int MPI_Iallgather(const void *sendbuf, int sendcount, MPI_Datatype sendtype, void *recvbuf, int recvcount,
                   MPI_Datatype recvtype, MPI_Comm comm, MPI_Request *request) {
  int size = 1;
  PMPI_Comm_size(comm, &size);
  charge(bytes_of(recvcount, recvtype) * (size - 1));
  return PMPI_Iallgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, request);
}

int MPI_Bcast(void *buf, int count, MPI_Datatype type, int root, MPI_Comm comm) {
  charge(bytes_of(count, type));
  return PMPI_Bcast(buf, count, type, root, comm);
}

int MPI_Ibcast(void *buf, int count, MPI_Datatype type, int root, MPI_Comm comm, MPI_Request *request) {
  charge(bytes_of(count, type));
  return PMPI_Ibcast(buf, count, type, root, comm, request);
}
