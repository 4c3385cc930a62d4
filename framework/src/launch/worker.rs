//! One worker process (`dtrain worker`): its transport through the rendezvous ([`connect`]),
//! its trainer, and — under live membership over tcp — joining the running group again
//! when the others dropped it while it was alive.

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::PathBuf;
use std::time::Duration;

use dtrain_comms::rendezvous::{self, RendezvousConfig};
use dtrain_comms::shaping::LinkSpec;
use dtrain_comms::transport::hybrid::HybridTransport;
use dtrain_comms::{
    CommConfig, Communicator, QuicConfig, QuicTransport, ShmConfig, ShmTransport, TcpConfig,
    TcpTransport, Transport,
};

use super::{hosts, LaunchError, Liveness, RENDEZVOUS_TIMEOUT, TOKEN_ENV};
use crate::config::{ClusterMode, RunConfig, TransportKind};
use crate::data::TrainData;
use crate::mpi_env::MpiEnv;
use crate::signals::{self, StopRequest};
use crate::trainer::{Observer, RunDir, Summary, TrainError, Trainer};

/// Builds the transport of one rank through the rendezvous at `host` (waiting at most
/// `timeout` for the other ranks); tcp and quic connections watch their peers with
/// `liveness`. `joining`: the rank takes a lost rank's place in a running group (tcp, quic
/// and hybrid; see [`TcpTransport::join`], [`QuicTransport::join`]).
#[allow(clippy::too_many_arguments)]
pub fn connect(
    kind: TransportKind,
    host: SocketAddr,
    rank: usize,
    world: usize,
    link: LinkSpec,
    token: &str,
    timeout: Duration,
    liveness: Liveness,
    joining: bool,
) -> Result<Box<dyn Transport>, String> {
    let rcfg = RendezvousConfig {
        timeout,
        ..RendezvousConfig::new(token.as_bytes().to_vec())
    };
    let ip = rendezvous::bind_ip_for(host);
    // A TCP listener of this rank, the rendezvous joined with its address.
    let listen_and_join = || -> Result<(TcpListener, rendezvous::Joined), String> {
        let l = TcpListener::bind((ip, 0)).map_err(|e| e.to_string())?;
        let me = l.local_addr().map_err(|e| e.to_string())?;
        let j = rendezvous::join(host, rank, world, me, &rcfg).map_err(|e| e.to_string())?;
        Ok((l, j))
    };
    let tcp = TcpConfig {
        link,
        heartbeat_interval: Some(liveness.heartbeat),
        peer_timeout: Some(liveness.peer_timeout),
        ..TcpConfig::new(token.as_bytes().to_vec())
    };
    Ok(match kind {
        TransportKind::Tcp => {
            let (l, j) = listen_and_join()?;
            let tcp = TcpConfig {
                accept_joiners: liveness.accept_joiners,
                ..tcp
            };
            let t = if joining {
                TcpTransport::join(rank, &j.peers, l, tcp)
            } else {
                TcpTransport::connect(rank, &j.peers, l, tcp)
            };
            Box::new(t.map_err(|e| e.to_string())?)
        }
        TransportKind::Hybrid if joining => {
            // Over TCP alone: no host keys, no rings (see HybridTransport::join).
            let (l, j) = listen_and_join()?;
            let tcp = TcpConfig {
                accept_joiners: liveness.accept_joiners,
                ..tcp
            };
            Box::new(HybridTransport::join(rank, &j.peers, l, tcp).map_err(|e| e.to_string())?)
        }
        TransportKind::Quic => {
            let s = UdpSocket::bind((ip, 0)).map_err(|e| e.to_string())?;
            let me = s.local_addr().map_err(|e| e.to_string())?;
            let j = rendezvous::join(host, rank, world, me, &rcfg).map_err(|e| e.to_string())?;
            let cfg = QuicConfig {
                link,
                heartbeat_interval: Some(liveness.heartbeat),
                peer_timeout: Some(liveness.peer_timeout),
                accept_joiners: liveness.accept_joiners,
                ..QuicConfig::new(token.as_bytes().to_vec(), j.identity)
            };
            let t = if joining {
                QuicTransport::join(rank, &j.peers, s, cfg)
            } else {
                QuicTransport::connect(rank, &j.peers, s, cfg)
            };
            Box::new(t.map_err(|e| e.to_string())?)
        }
        _ if joining => {
            return Err(format!(
                "transport {kind:?}: only tcp, quic and hybrid accept a worker joining a \
                 running group (use one of them with cluster.membership = \"live\")"
            ))
        }
        TransportKind::Shm => {
            // The rendezvous still runs (it checks the token and tells every rank the world);
            // the address joined with is only this host's, for the same-host check.
            let (_l, j) = listen_and_join()?;
            if !dtrain_comms::transport::shm::same_host(&j.peers) {
                return Err(format!(
                    "transport shm needs every rank on one host; the ranks joined from {:?} \
                     (use tcp or quic across hosts)",
                    j.peers
                ));
            }
            let cfg = ShmConfig {
                link,
                connect_timeout: timeout,
                ..ShmConfig::from_joined(token.as_bytes().to_vec(), &j)
            };
            Box::new(ShmTransport::connect(rank, world, cfg).map_err(|e| e.to_string())?)
        }
        TransportKind::Hybrid => {
            let (l, j) = listen_and_join()?;
            let tcp = TcpConfig {
                accept_joiners: liveness.accept_joiners,
                ..tcp
            };
            // The emulated link is the network's: the host-local rings are not shaped.
            let shm = ShmConfig {
                connect_timeout: timeout,
                ..ShmConfig::from_joined(token.as_bytes().to_vec(), &j)
            };
            Box::new(
                HybridTransport::connect(rank, &j.peers, l, tcp, shm, &hosts::host_key())
                    .map_err(|e| e.to_string())?,
            )
        }
        TransportKind::Mpi => {
            return Err(
                "transport mpi: the ranks and their connections are MPI's (started by \
                        mpirun), not the rendezvous's; see crate::mpi_env"
                    .into(),
            )
        }
        TransportKind::Auto => {
            return Err(
                "transport auto is resolved by the launcher (resolve_transport) before the \
                 workers connect; a worker needs a concrete transport"
                    .into(),
            )
        }
    })
}

/// A worker's arguments (what [`super::launch`] passes to `dtrain worker`).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerArgs {
    /// The run directory (holds `config.toml`).
    pub run_dir: PathBuf,
    /// The rendezvous host.
    pub rendezvous: SocketAddr,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Resume from the run directory's latest checkpoint.
    pub resume: bool,
    /// Take this rank's place in the running group (live membership): join the rendezvous
    /// late, connect to the members (`TcpTransport::join`), receive their state
    /// ([`Trainer::join`]).
    pub join: bool,
}

/// Runs one worker to the end: loads the run's config, opens its data shard, connects,
/// trains. The token comes from [`TOKEN_ENV`].
///
/// Started by `dtrain run` ([`signals::LAUNCHER_PID_ENV`] set), it dies with its launcher
/// ([`signals::die_with_launcher`]). SIGTERM / SIGINT stop it after the step the ranks agree
/// on, with a checkpoint ([`Trainer::stop_on`]): [`LaunchError::Stopped`]. Without a
/// launcher (a rank started by a scheduler), a second signal ends it at once.
///
/// Under live membership over tcp, a worker the others dropped while it was alive (frozen
/// past the step deadline, say) comes back as a newcomer: it joins the running group again
/// (as `--join` does) instead of failing, up to [`REJOINS`] times.
pub fn worker(a: &WorkerArgs, obs: &mut dyn Observer) -> Result<Summary, LaunchError> {
    signals::die_with_launcher()?;
    let launched = std::env::var_os(signals::LAUNCHER_PID_ENV).is_some();
    let _caught =
        signals::catch(!launched).map_err(|e| format!("catching SIGTERM / SIGINT: {e}"))?;
    let stop = StopRequest::process();
    let mut a = a.clone();
    for rejoin in 0.. {
        match train_once(&a, &stop, obs)? {
            Once::Done(s) => return Ok(*s),
            Once::Excluded(why) if rejoin < REJOINS => {
                obs.on_message(&format!(
                    "rank {}: dropped from the group while alive ({why}); joining it again \
                     as a newcomer",
                    a.rank
                ));
                a.join = true;
                a.resume = false;
            }
            Once::Excluded(why) => return Err(LaunchError::Failed(why)),
        }
    }
    unreachable!("the loop returns")
}

/// How many times a worker dropped while alive joins its group again ([`worker`]).
pub const REJOINS: usize = 3;

/// How one [`train_once`] ended, when not with an error.
enum Once {
    /// The run is complete.
    Done(Box<Summary>),
    /// The group went on without this worker, which was alive (live membership, tcp):
    /// it may join again.
    Excluded(String),
}

/// [`worker`]'s body: connect (or join), train to the end.
fn train_once(
    a: &WorkerArgs,
    stop: &StopRequest,
    obs: &mut dyn Observer,
) -> Result<Once, LaunchError> {
    let before_training = |stage: &str| match stop.signal() {
        Some(signal) => Err(LaunchError::Stopped {
            signal,
            message: format!(
                "{} received {stage}: stopped (no new checkpoint)",
                signals::signal_name(signal)
            ),
        }),
        None => Ok(()),
    };
    let token = std::env::var(TOKEN_ENV).map_err(|_| format!("{TOKEN_ENV} is not set"));
    let path = a.run_dir.join("config.toml");
    let file = path.display().to_string();
    let cfg = RunConfig::load(&path, &[]).map_err(|e| e.to_string())?;
    // With MPI the rank is MPI's (every process got the same arguments from mpirun); the
    // environment lives until the end of the run (MPI is finalised when it is dropped).
    let mpi = match cfg.cluster.transport {
        TransportKind::Mpi => Some(MpiEnv::init_for(a.world)?),
        _ => None,
    };
    let a = &WorkerArgs {
        rank: mpi.as_ref().map_or(a.rank, MpiEnv::rank),
        ..a.clone()
    };
    let data = TrainData::open(&cfg, a.rank, a.world).map_err(|e| format!("{file}: data: {e}"))?;
    before_training("while loading the data")?;
    let plan = cfg
        .validate(&file, Some(data.train_examples()))
        .map_err(|e| e.to_string())?;
    let link = LinkSpec::parse(
        cfg.network.bandwidth.as_deref(),
        cfg.network.latency.as_deref(),
    )?;
    let transport = match &mpi {
        Some(env) => {
            if link.is_shaped() {
                return Err(format!(
                    "{file}: network.bandwidth / latency are emulated by the tcp, quic and shm \
                     transports, not by mpi"
                )
                .into());
            }
            env.transport()?
        }
        None => connect(
            cfg.cluster.transport,
            a.rendezvous,
            a.rank,
            a.world,
            link,
            &token?,
            RENDEZVOUS_TIMEOUT,
            cfg.cluster.liveness(cfg.live_membership()),
            a.join,
        )
        .map_err(|e| {
            if a.join {
                LaunchError::NotJoined(format!("joining the running group: {e}"))
            } else {
                e.into()
            }
        })?,
    };
    // Parameter-server mode: the server's messages share the connections of the collectives.
    // Exchanges in flight across steps (Streaming DiLoCo) likewise get a second lane, run
    // from a thread of their own; MPI's transport is driven from one thread, so there they
    // block their step instead.
    let (transport, ps_lane, second_lane): (Box<dyn Transport>, _, Option<Box<dyn Transport>>) =
        if cfg.cluster.mode == ClusterMode::Ps {
            let (coll, ps) = dtrain_comms::split_ps(transport);
            (Box::new(coll), Some(Box::new(ps)), None)
        } else if cfg.sync.wants_second_lane() && mpi.is_none() {
            let (coll, second) = dtrain_comms::split_tagged(transport);
            (Box::new(coll), None, Some(Box::new(second)))
        } else {
            (transport, None, None)
        };
    let comm = Communicator::new(
        transport,
        CommConfig {
            timeout: Duration::from_secs_f64(cfg.cluster.timeout_s),
            ..CommConfig::default()
        },
    );
    // Before the device opens, so that no product has run yet.
    dtrain_models::precision::set_allow_tf32(cfg.cluster.allow_tf32);
    let device =
        crate::device::worker_device(cfg.cluster.device, crate::device::local_rank(a.rank))
            .map_err(|e| format!("{file}: {e}"))?;
    let out = RunDir {
        root: a.run_dir.clone(),
    };
    let mut t = if a.join {
        // Up to the membership deadline's ceiling for the members to admit it: they do so
        // at their next step boundary (a periodic [sync]'s: at its round's end).
        let timeout = Duration::from_secs_f64(cfg.cluster.timeout_s.max(60.0));
        Trainer::join(plan, data, comm, &device, Some(out.clone()), timeout)
            .map_err(|e| LaunchError::NotJoined(format!("joining the running group: {e}")))?
    } else {
        Trainer::new(plan, data, comm, &device, Some(out.clone())).map_err(|e| e.to_string())?
    };
    if let Some(lane) = ps_lane {
        t.attach_parameter_server(lane).map_err(|e| e.to_string())?;
    }
    if let Some(lane) = second_lane {
        t.attach_background(lane).map_err(|e| e.to_string())?;
    }
    if a.resume {
        let dir = out
            .latest()
            .ok_or_else(|| format!("{}: no checkpoint to resume from", a.run_dir.display()))?;
        t.resume_from(&dir).map_err(|e| e.to_string())?;
    }
    before_training("before the first step")?;
    t.stop_on(stop.clone());
    let rejoins = cfg.live_membership() && cfg.cluster.transport.takes_newcomers();
    let summary = match t.run(obs) {
        Ok(s) => Ok(Once::Done(Box::new(s))),
        Err(e @ TrainError::Stopped { signal, .. }) => Err(LaunchError::Stopped {
            signal,
            message: e.to_string(),
        }),
        // Dropped while alive (stopped past the deadline): in the step's control all-reduce
        // or in its gradient exchange, whichever collective it was in.
        Err(e)
            if rejoins
                && matches!(
                    e.comm_error(),
                    Some(dtrain_comms::CommError::Excluded { .. })
                ) =>
        {
            Ok(Once::Excluded(e.to_string()))
        }
        Err(e) => Err(LaunchError::Failed(e.to_string())),
    };
    // The trainer (and its transport) goes before MPI is finalised.
    drop(t);
    drop(mpi);
    summary
}
