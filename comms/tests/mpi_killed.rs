//! A rank killed with SIGKILL under `mpirun` (feature `mpi`): every survivor's collective
//! fails within the timeout with an error naming the dead rank, and no rank hangs.
//!
//! Open MPI aborts the whole job when a process dies unless its runtime is told to keep the
//! survivors running, so this check needs
//!
//! ```text
//! cargo test -p dtrain-comms --features mpi --test mpi_killed --no-run
//! mpirun --oversubscribe --mca orte_enable_recovery 1 --mca orte_abort_on_non_zero_status 0 \
//!     -n 3 target/debug/deps/mpi_killed-<hash>
//! ```
//!
//! (CI runs it so, for 2 and 4 ranks). The dead rank is then simply silent: the driver's
//! non-blocking receive sees nothing from it, [`Communicator`]'s timeout fires on the rank
//! that waits for it, and the abort notices carry its name to every other survivor. Run
//! without `mpirun` (a singleton) there is no peer to kill and it passes trivially.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::exit_on_hang_or_panic;
use dtrain_comms::{CommConfig, CommError, Communicator, MpiTransport};
use mpi::environment::Threading;
use mpi::topology::Communicator as _;

fn main() {
    // The survivors must be done long before the watchdog fires.
    exit_on_hang_or_panic("mpi_killed", Duration::from_secs(60));
    let (universe, _) =
        mpi::initialize_with_threading(Threading::Serialized).expect("MPI initialises once");
    let world = universe.world();
    let (me, size) = (world.rank() as usize, world.size() as usize);
    if size < 2 {
        println!("mpi_killed: singleton, nothing to kill: 0 checks");
        return;
    }
    let victim = size / 2;
    let timeout = Duration::from_secs(3);
    let cfg = CommConfig {
        timeout,
        abort_grace: Duration::from_secs(1),
        ..CommConfig::default()
    };
    let mut c = Communicator::new(MpiTransport::new(&world).expect("MPI transport"), cfg);
    // One good call first: everyone is up and has exchanged messages.
    let mut v = vec![1.0f32; 4096];
    c.all_reduce_sum(&mut v)
        .expect("all-reduce with every rank alive");
    assert!(v.iter().all(|&x| x == size as f32));
    // Everyone must also have finished receiving that call before the victim dies: Open MPI
    // moves larger messages between local ranks by reading the sender's memory (CMA single
    // copy), and a rank still reading from a killed process hangs inside MPI. Seen in CI: the
    // victim's return from the all-reduce did not mean rank 0 had copied its 16 KB message.
    // A barrier's messages are small (copied eagerly), so after it the victim owes nothing.
    c.barrier().expect("barrier with every rank alive");
    if me == victim {
        // Die the hard way: no destructor, no close notice, no MPI_Finalize.
        let pid = std::process::id().to_string();
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid])
            .status();
        thread::sleep(Duration::from_secs(60));
        unreachable!("SIGKILL did not end rank {me}");
    }
    // Give the victim time to die, so the next call really meets a dead rank.
    thread::sleep(Duration::from_millis(500));
    let start = Instant::now();
    let e = c
        .all_reduce_sum(&mut v)
        .expect_err("an all-reduce with a dead rank fails");
    let took = start.elapsed();
    assert!(
        took < timeout + Duration::from_secs(2),
        "rank {me}: the error took {took:?}"
    );
    assert!(
        matches!(e, CommError::Timeout { .. } | CommError::PeerLost { .. }),
        "rank {me}: {e}"
    );
    assert_eq!(e.failed_ranks(), vec![victim], "rank {me}: {e}");
    println!("mpi_killed: rank {me} of {size}: \"{e}\" after {took:?}");
    // MPI_Finalize would wait for the dead rank: leave without it, successfully.
    std::process::exit(0);
}
