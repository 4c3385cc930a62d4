//! Ranks started by `mpirun`: `cluster.transport = "mpi"` and `bench allreduce --transport mpi`.
//!
//! With the `mpi` feature, [`MpiEnv::init`] initialises MPI (threading level `Serialized`,
//! which `dtrain_comms::MpiTransport` needs) and hands out this process's rank, the world
//! size and the transport. The environment must outlive every transport made from it: MPI is
//! finalised when it is dropped. Without the feature every entry point fails with a message
//! that says how to build a `dtrain` that has it.
//!
//! [`mpirun_command`] builds the `mpirun` invocation the launchers use on one node:
//! `mpirun -n N --oversubscribe <exe> <args…>`, where `mpirun` can be replaced through the
//! `DTRAIN_MPIRUN` environment variable; Open MPI's run-as-root confirmation variables are
//! set so that containers running as root work too.

use std::path::Path;
use std::process::Command;

#[cfg(not(feature = "mpi"))]
use dtrain_comms::Transport;

/// Environment variable naming the `mpirun` to use (default `mpirun`).
pub const MPIRUN_ENV: &str = "DTRAIN_MPIRUN";

/// `mpirun -n world --oversubscribe exe args…`, stdin closed.
pub fn mpirun_command(world: usize, exe: &Path, args: &[String]) -> Command {
    let mpirun = std::env::var(MPIRUN_ENV).unwrap_or_else(|_| "mpirun".into());
    let mut cmd = Command::new(mpirun);
    cmd.arg("-n")
        .arg(world.to_string())
        .arg("--oversubscribe")
        .arg(exe)
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdin(std::process::Stdio::null());
    cmd
}

#[cfg(not(feature = "mpi"))]
const NO_MPI: &str = "transport mpi: this dtrain was built without MPI support; rebuild it \
     with `cargo build --release -p dtrain-cli --features mpi` (needs Open MPI and libclang)";

/// An initialised MPI environment (see the [module docs](self)).
#[cfg(feature = "mpi")]
pub struct MpiEnv {
    universe: mpi::environment::Universe,
}

/// An initialised MPI environment (see the [module docs](self)); this build has no MPI, so
/// none can be made.
#[cfg(not(feature = "mpi"))]
pub struct MpiEnv {
    _never: std::convert::Infallible,
}

#[cfg(feature = "mpi")]
impl MpiEnv {
    /// Initialises MPI; fails when it was initialised before or when the library cannot
    /// give the `Serialized` threading level.
    pub fn init() -> Result<MpiEnv, String> {
        use mpi::environment::Threading;
        let (universe, level) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or("transport mpi: MPI was already initialised in this process")?;
        if level < Threading::Serialized {
            return Err(format!(
                "transport mpi: the MPI library offers threading level {level:?}, at least \
                 Serialized is needed"
            ));
        }
        Ok(MpiEnv { universe })
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> usize {
        use mpi::topology::Communicator;
        self.universe.world().rank() as usize
    }

    /// The number of ranks `mpirun` started.
    pub fn size(&self) -> usize {
        use mpi::topology::Communicator;
        self.universe.world().size() as usize
    }

    /// A transport over `MPI_COMM_WORLD` (a duplicate of it: dtrain's messages never mix
    /// with anyone else's).
    pub fn transport(&self) -> Result<Box<dyn dtrain_comms::Transport>, String> {
        let t = dtrain_comms::MpiTransport::new(&self.universe.world())
            .map_err(|e| format!("transport mpi: {e}"))?;
        Ok(Box::new(t))
    }
}

#[cfg(not(feature = "mpi"))]
impl Drop for MpiEnv {
    fn drop(&mut self) {
        match self._never {}
    }
}

#[cfg(not(feature = "mpi"))]
impl MpiEnv {
    /// Fails: this build has no MPI.
    pub fn init() -> Result<MpiEnv, String> {
        Err(NO_MPI.into())
    }

    /// This process's rank (unreachable: no `MpiEnv` exists without MPI).
    pub fn rank(&self) -> usize {
        match self._never {}
    }

    /// The number of ranks (unreachable: no `MpiEnv` exists without MPI).
    pub fn size(&self) -> usize {
        match self._never {}
    }

    /// A transport (unreachable: no `MpiEnv` exists without MPI).
    pub fn transport(&self) -> Result<Box<dyn Transport>, String> {
        match self._never {}
    }
}

impl MpiEnv {
    /// [`MpiEnv::init`], checking that `mpirun` started `world` ranks.
    pub fn init_for(world: usize) -> Result<MpiEnv, String> {
        let env = MpiEnv::init()?;
        if env.size() != world {
            return Err(format!(
                "transport mpi: {world} ranks expected, but mpirun started {}",
                env.size()
            ));
        }
        Ok(env)
    }
}
