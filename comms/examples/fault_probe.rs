//! What the surviving ranks see when one rank dies or goes quiet, with one process per
//! rank over TCP or QUIC on 127.0.0.1.
//!
//! ```text
//! cargo build --release -p dtrain-comms --example fault_probe
//! target/release/examples/fault_probe [--transport tcp|quic] [--ranks 3]
//!     [--fault kill|stop|stall] [--when during|between] [--timeout-ms 30000]
//!     [--grace-ms 2000] [--peer-timeout-ms 10000] [--heartbeat-ms 1000]
//! ```
//!
//! The parent hosts a rendezvous and starts one child process per rank; the children
//! all-reduce 4 MB in a loop. The last rank is the victim:
//! * `kill`: it SIGKILLs itself (no close, no abort);
//! * `stop`: it SIGSTOPs itself (process frozen, sockets open, nothing sent);
//! * `stall`: it stops calling collectives for four timeouts, but stays alive.
//!
//! `during`: the fault strikes from a helper thread 300 ms into the loop, i.e. inside some
//! collective (not possible for `stall`, which always strikes between collectives);
//! `between`: right after the victim finished its fourth collective, while the others
//! enter the fifth. The parent prints, for every rank, the error it returned and how long
//! after the fault, or `HANG` if it returned nothing within 3 × timeout + 10 s.

use std::io::{BufRead, BufReader};
#[cfg(feature = "quic")]
use std::net::UdpSocket;
use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dtrain_comms::rendezvous::{self, Host, RendezvousConfig, RunIdentity};
use dtrain_comms::{CommConfig, Communicator, Transport};
#[cfg(feature = "quic")]
use dtrain_comms::{QuicConfig, QuicTransport};
use dtrain_comms::{TcpConfig, TcpTransport};

const CHILD: &str = "DTRAIN_FAULT_PROBE_CHILD";
const TOKEN: &[u8] = b"fault-probe";

#[derive(Clone, Debug)]
struct Opts {
    transport: String,
    ranks: usize,
    fault: String,
    when: String,
    timeout_ms: u64,
    grace_ms: u64,
    peer_timeout_ms: u64,
    heartbeat_ms: u64,
}

impl Opts {
    fn parse(args: &[String]) -> Opts {
        let mut o = Opts {
            transport: "tcp".into(),
            ranks: 3,
            fault: "stop".into(),
            when: "during".into(),
            timeout_ms: 30_000,
            grace_ms: 2_000,
            peer_timeout_ms: 10_000,
            heartbeat_ms: 1_000,
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let v = it.next().unwrap_or_else(|| panic!("{a} needs a value"));
            match a.as_str() {
                "--transport" => o.transport = v.clone(),
                "--ranks" => o.ranks = v.parse().expect("--ranks"),
                "--fault" => o.fault = v.clone(),
                "--when" => o.when = v.clone(),
                "--timeout-ms" => o.timeout_ms = v.parse().expect("--timeout-ms"),
                "--grace-ms" => o.grace_ms = v.parse().expect("--grace-ms"),
                "--peer-timeout-ms" => o.peer_timeout_ms = v.parse().expect("--peer-timeout-ms"),
                "--heartbeat-ms" => o.heartbeat_ms = v.parse().expect("--heartbeat-ms"),
                _ => panic!("unknown option {a}"),
            }
        }
        assert!(o.ranks >= 2, "--ranks must be at least 2");
        o
    }

    fn to_args(&self) -> Vec<String> {
        [
            ("--transport", self.transport.clone()),
            ("--ranks", self.ranks.to_string()),
            ("--fault", self.fault.clone()),
            ("--when", self.when.clone()),
            ("--timeout-ms", self.timeout_ms.to_string()),
            ("--grace-ms", self.grace_ms.to_string()),
            ("--peer-timeout-ms", self.peer_timeout_ms.to_string()),
            ("--heartbeat-ms", self.heartbeat_ms.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect()
    }
}

fn unix_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_micros()
}

fn signal_self(sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &std::process::id().to_string()])
        .status();
}

fn strike(o: &Opts) {
    println!("FAULT {}", unix_us());
    match o.fault.as_str() {
        "kill" => signal_self("-KILL"),
        "stop" => signal_self("-STOP"),
        "stall" => std::thread::sleep(Duration::from_millis(4 * o.timeout_ms)),
        f => panic!("unknown fault {f}"),
    }
}

fn connect(o: &Opts, rank: usize, host: SocketAddr) -> Box<dyn Transport> {
    let rcfg = RendezvousConfig::new(TOKEN.to_vec());
    let ms = Duration::from_millis;
    match o.transport.as_str() {
        "tcp" => {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let me = l.local_addr().unwrap();
            let j = rendezvous::join(host, rank, o.ranks, me, &rcfg).unwrap();
            let mut cfg = TcpConfig::new(TOKEN.to_vec());
            cfg.heartbeat_interval = (o.heartbeat_ms > 0).then(|| ms(o.heartbeat_ms));
            cfg.peer_timeout = (o.peer_timeout_ms > 0).then(|| ms(o.peer_timeout_ms));
            Box::new(TcpTransport::connect(rank, &j.peers, l, cfg).unwrap())
        }
        #[cfg(feature = "quic")]
        "quic" => {
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            let me = s.local_addr().unwrap();
            let j = rendezvous::join(host, rank, o.ranks, me, &rcfg).unwrap();
            let mut cfg = QuicConfig::new(TOKEN.to_vec(), j.identity);
            cfg.heartbeat_interval = (o.heartbeat_ms > 0).then(|| ms(o.heartbeat_ms));
            cfg.peer_timeout = (o.peer_timeout_ms > 0).then(|| ms(o.peer_timeout_ms));
            Box::new(QuicTransport::connect(rank, &j.peers, s, cfg).unwrap())
        }
        t => panic!("unknown transport {t}"),
    }
}

fn child(o: &Opts, rank: usize, host: SocketAddr) {
    let t = connect(o, rank, host);
    let cfg = CommConfig {
        timeout: Duration::from_millis(o.timeout_ms),
        abort_grace: Duration::from_millis(o.grace_ms),
        ..CommConfig::default()
    };
    let mut c = Communicator::new(t, cfg);
    c.barrier().unwrap();
    let victim = rank == o.ranks - 1;
    if victim && o.when == "during" && o.fault != "stall" {
        let o = o.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            strike(&o);
        });
    }
    let mut v = vec![1.0f32; 1 << 20];
    let start = Instant::now();
    let limit = Duration::from_millis(3 * o.timeout_ms + 10_000);
    for i in 0.. {
        if victim && (o.when == "between" || o.fault == "stall") && i == 4 {
            strike(o);
        }
        if let Err(e) = c.all_reduce_sum(&mut v) {
            println!("ERR {} {e}", unix_us());
            return;
        }
        if start.elapsed() > limit {
            println!("OK {} no error after {i} collectives", unix_us());
            return;
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = Opts::parse(&args);
    if let Ok(spec) = std::env::var(CHILD) {
        let (rank, host) = spec.split_once(',').expect("rank,host");
        child(&o, rank.parse().unwrap(), host.parse().unwrap());
        return;
    }
    #[cfg(feature = "quic")]
    let identity = if o.transport == "quic" {
        RunIdentity::generate().unwrap()
    } else {
        RunIdentity::default()
    };
    #[cfg(not(feature = "quic"))]
    let identity = RunIdentity::default();
    let rdv = TcpListener::bind("127.0.0.1:0").unwrap();
    let host = Host::spawn(
        rdv,
        o.ranks,
        identity,
        RendezvousConfig::new(TOKEN.to_vec()),
    )
    .unwrap();
    let exe = std::env::current_exe().unwrap();
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut children = Vec::new();
    for r in 0..o.ranks {
        let mut ch = Command::new(&exe)
            .args(o.to_args())
            .env(CHILD, format!("{r},{}", host.addr()))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = ch.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((r, line));
            }
        });
        children.push(ch);
    }
    drop(tx);
    let victim = o.ranks - 1;
    let deadline = Instant::now() + Duration::from_millis(3 * o.timeout_ms + 20_000);
    let mut fault: Option<u128> = None;
    let mut results: Vec<Option<(u128, String)>> = vec![None; o.ranks];
    while results
        .iter()
        .enumerate()
        .any(|(r, x)| r != victim && x.is_none())
    {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok((r, line)) = rx.recv_timeout(left) else {
            break;
        };
        let mut parts = line.splitn(3, ' ');
        let (kind, at) = (parts.next().unwrap_or(""), parts.next().unwrap_or("0"));
        let at: u128 = at.parse().unwrap_or(0);
        match kind {
            "FAULT" => fault = Some(at),
            "ERR" | "OK" => {
                results[r] = Some((at, format!("{kind}: {}", parts.next().unwrap_or(""))))
            }
            _ => {}
        }
    }
    // Let a stalled victim report too (it resumes after four timeouts).
    if o.fault == "stall" {
        let until = Instant::now() + Duration::from_millis(4 * o.timeout_ms + 5_000);
        while results[victim].is_none() {
            let left = until.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((r, line)) if line.starts_with("ERR") || line.starts_with("OK") => {
                    let mut p = line.splitn(3, ' ');
                    let kind = p.next().unwrap_or("").to_string();
                    let at = p.next().unwrap_or("0").parse().unwrap_or(0);
                    results[r] = Some((at, format!("{kind}: {}", p.next().unwrap_or(""))));
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }
    for ch in &mut children {
        let _ = ch.kill();
        let _ = ch.wait();
    }
    println!(
        "# {} ranks over {}, victim rank {victim}: {} {}, timeout {} ms, grace {} ms, \
         peer timeout {} ms, heartbeat {} ms",
        o.ranks,
        o.transport,
        o.fault,
        if o.fault == "stall" {
            "between"
        } else {
            &o.when
        },
        o.timeout_ms,
        o.grace_ms,
        o.peer_timeout_ms,
        o.heartbeat_ms
    );
    for (r, res) in results.iter().enumerate() {
        match (res, fault) {
            (Some((at, what)), Some(f)) => {
                let dt = (*at as f64 - f as f64) / 1e6;
                println!("rank {r}: after {dt:6.2} s  {what}");
            }
            (Some((_, what)), None) => println!("rank {r}: (no fault seen) {what}"),
            (None, _) if r == victim => println!("rank {r}: (victim)"),
            (None, _) => println!("rank {r}: HANG (nothing within the probe's deadline)"),
        }
    }
}
