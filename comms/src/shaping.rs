//! Link emulation as a sans-IO model: bandwidth (serialisation delay) and one-way latency.
//!
//! `[network] bandwidth = "1Gbit"`, `latency = "100us"` shape every worker's egress so a
//! bandwidth-starved cluster can be reproduced on one host with real bytes and real time,
//! without root (`tc netem` is not available here). The model is the α–β link the
//! simulator and the papers use:
//!
//! * the link serialises one frame at a time at `rate` bytes/s: a frame of `n` bytes that is
//!   offered at time `t` starts when the link is free, `s = max(t, busy_until)`, and departs
//!   at `d = s + n/rate`;
//! * it arrives (is handed to the real socket) at `a = d + latency`. Frames pipeline: the
//!   latency of back-to-back frames overlaps, as on a real wire.
//!
//! The model only computes times; the transport driver sleeps until [`Release::at`] and then
//! writes the frame. Times are `Duration`s since an arbitrary epoch chosen by the driver.
//!
//! The TCP, QUIC and shared-memory drivers apply it per worker ([`LinkSpec`] in their configs): one
//! [`Link`] shared by all of the worker's connections (its NIC), offered each frame when
//! [`crate::Transport::send`] queues it (so latency pipelines over back-to-back frames); the
//! connection's writer task sleeps until the frame's release time and then writes it. The
//! [`LinkSpec::predict_all_reduce`] family gives the α–β predictions that emulated runs are
//! compared against.

use std::time::{Duration, Instant};

/// Parses a bandwidth such as `"1Gbit"`, `"100Mbit"`, `"10Gbps"`, `"2.5GB/s"`,
/// `"500MiB/s"`, `"800kbit"`; returns bytes per second.
pub fn parse_bandwidth(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .ok_or_else(|| format!("bandwidth {s:?} has no unit (e.g. \"1Gbit\", \"100MB/s\")"))?;
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .replace('_', "")
        .parse()
        .map_err(|_| format!("bandwidth {s:?}: {num:?} is not a number"))?;
    let unit = unit.trim();
    let (scale, bits) = match unit {
        "bit" | "bps" | "bit/s" => (1.0, true),
        "kbit" | "kbps" | "kbit/s" | "Kbit" => (1e3, true),
        "Mbit" | "Mbps" | "Mbit/s" => (1e6, true),
        "Gbit" | "Gbps" | "Gbit/s" => (1e9, true),
        "Tbit" | "Tbps" | "Tbit/s" => (1e12, true),
        "B/s" => (1.0, false),
        "kB/s" | "KB/s" => (1e3, false),
        "MB/s" => (1e6, false),
        "GB/s" => (1e9, false),
        "KiB/s" => (1024.0, false),
        "MiB/s" => (1024.0 * 1024.0, false),
        "GiB/s" => (1024.0 * 1024.0 * 1024.0, false),
        _ => {
            return Err(format!(
            "bandwidth {s:?}: unknown unit {unit:?} (bit, kbit, Mbit, Gbit, Gbps, MB/s, GiB/s, …)"
        ))
        }
    };
    let bytes = v * scale / if bits { 8.0 } else { 1.0 };
    if !(bytes.is_finite() && bytes > 0.0) {
        return Err(format!("bandwidth {s:?} must be positive"));
    }
    Ok(bytes)
}

/// Parses a duration such as `"100us"`, `"1.5ms"`, `"2s"`, `"0"`, `"250ns"`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("duration {s:?} has no unit (ns, us, ms, s)"))?;
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("duration {s:?}: {num:?} is not a number"))?;
    let secs = match unit.trim() {
        "ns" => v * 1e-9,
        "us" | "µs" => v * 1e-6,
        "ms" => v * 1e-3,
        "s" => v,
        u => {
            return Err(format!(
                "duration {s:?}: unknown unit {u:?} (ns, us, ms, s)"
            ))
        }
    };
    if !(secs.is_finite() && secs >= 0.0) {
        return Err(format!("duration {s:?} must be >= 0"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// When a frame may be handed to the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    /// Time the last byte leaves the emulated link (serialisation done).
    pub departs: Duration,
    /// Time the frame is delivered (departure + latency): write it to the socket then.
    pub at: Duration,
}

/// One emulated egress link.
#[derive(Debug, Clone)]
pub struct Link {
    /// Bytes per second; `None` = unlimited.
    rate: Option<f64>,
    latency: Duration,
    busy_until: Duration,
}

impl Link {
    /// A link with the given rate (bytes/s, `None` = unlimited) and one-way latency.
    pub fn new(rate: Option<f64>, latency: Duration) -> Self {
        Link {
            rate,
            latency,
            busy_until: Duration::ZERO,
        }
    }

    /// An unshaped link (releases immediately).
    pub fn unlimited() -> Self {
        Self::new(None, Duration::ZERO)
    }

    /// Whether this link delays anything.
    pub fn is_shaped(&self) -> bool {
        self.rate.is_some() || !self.latency.is_zero()
    }

    /// Offers a frame of `bytes` at time `now`; returns when it departs and arrives.
    pub fn offer(&mut self, now: Duration, bytes: usize) -> Release {
        let start = now.max(self.busy_until);
        let ser = match self.rate {
            Some(r) => Duration::from_secs_f64(bytes as f64 / r),
            None => Duration::ZERO,
        };
        let departs = start + ser;
        self.busy_until = departs;
        Release {
            departs,
            at: departs + self.latency,
        }
    }
}

/// A worker's emulated egress link, as configured: rate and one-way latency. The default
/// is unshaped.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LinkSpec {
    /// Bytes per second; `None` = unlimited.
    pub bandwidth: Option<f64>,
    /// One-way latency added to every frame.
    pub latency: Duration,
}

impl LinkSpec {
    /// Parses the configuration strings (`bandwidth = "1Gbit"`, `latency = "100us"`); a
    /// missing value means unlimited / zero.
    pub fn parse(bandwidth: Option<&str>, latency: Option<&str>) -> Result<Self, String> {
        Ok(LinkSpec {
            bandwidth: bandwidth.map(parse_bandwidth).transpose()?,
            latency: latency.map(parse_duration).transpose()?.unwrap_or_default(),
        })
    }

    /// Whether this spec delays anything.
    pub fn is_shaped(&self) -> bool {
        self.bandwidth.is_some() || !self.latency.is_zero()
    }

    /// A fresh [`Link`] with this rate and latency.
    pub fn link(&self) -> Link {
        Link::new(self.bandwidth, self.latency)
    }

    /// α–β prediction of a ring all-reduce of `bytes` over `world` ranks, in seconds:
    /// `2(N−1)/N · bytes/rate + 2(N−1) · latency` (every rank sends `2(N−1)/N` of the
    /// buffer over its own link in `2(N−1)` dependent steps).
    pub fn predict_all_reduce(&self, bytes: f64, world: usize) -> f64 {
        let n = world as f64;
        if world < 2 {
            return 0.0;
        }
        let steps = 2.0 * (n - 1.0);
        steps / n * self.serialise(bytes) + steps * self.latency.as_secs_f64()
    }

    /// α–β prediction of an all-gather producing `total_bytes` on every rank (each rank
    /// contributes `total_bytes / N`): `(N−1)/N · total/rate + (N−1) · latency`.
    pub fn predict_all_gather(&self, total_bytes: f64, world: usize) -> f64 {
        let n = world as f64;
        if world < 2 {
            return 0.0;
        }
        (n - 1.0) / n * self.serialise(total_bytes) + (n - 1.0) * self.latency.as_secs_f64()
    }

    /// α–β prediction of a pipelined chain broadcast of `bytes`:
    /// `bytes/rate + (N−1) · latency` (the first-order term; chunk fill is ignored).
    pub fn predict_broadcast(&self, bytes: f64, world: usize) -> f64 {
        if world < 2 {
            return 0.0;
        }
        self.serialise(bytes) + (world as f64 - 1.0) * self.latency.as_secs_f64()
    }

    /// α–β prediction of a recursive-doubling all-reduce of `bytes` (what
    /// [`crate::Communicator`] runs for small buffers): every round exchanges the whole
    /// buffer, so `rounds · (bytes/rate + latency)`, with `rounds = log2 P2` plus a fold-in
    /// and a fold-out round when `N` is not a power of two (`P2` the largest power of two
    /// `≤ N`).
    pub fn predict_recursive_doubling(&self, bytes: f64, world: usize) -> f64 {
        if world < 2 {
            return 0.0;
        }
        let p2 = 1usize << (usize::BITS - 1 - world.leading_zeros());
        let rounds = p2.trailing_zeros() as f64 + if p2 == world { 0.0 } else { 2.0 };
        rounds * (self.serialise(bytes) + self.latency.as_secs_f64())
    }

    /// α–β prediction of a binomial-tree broadcast of `bytes` (not pipelined):
    /// `⌈log2 N⌉ · (bytes/rate + latency)`.
    pub fn predict_tree_broadcast(&self, bytes: f64, world: usize) -> f64 {
        if world < 2 {
            return 0.0;
        }
        let depth = (usize::BITS - (world - 1).leading_zeros()) as f64;
        depth * (self.serialise(bytes) + self.latency.as_secs_f64())
    }

    /// α–β prediction of a parameter-server push + pull of `bytes` per worker, sharded
    /// evenly over `servers` server links: each server receives `N · bytes/servers` and
    /// sends as much back, while a worker's own link carries `bytes` each way, so the time
    /// is `2 · max(N/servers, 1) · bytes/rate + 2 · latency`.
    pub fn predict_parameter_server(&self, bytes: f64, world: usize, servers: usize) -> f64 {
        if world < 1 {
            return 0.0;
        }
        let fan_in = (world as f64 / servers.max(1) as f64).max(1.0);
        2.0 * fan_in * self.serialise(bytes) + 2.0 * self.latency.as_secs_f64()
    }

    fn serialise(&self, bytes: f64) -> f64 {
        self.bandwidth.map_or(0.0, |r| bytes / r)
    }
}

/// A worker's emulated egress link over real time: one [`Link`] shared by all its
/// connections (or rings), with `epoch` as the model's time zero. The stream drivers and
/// the shared-memory driver stamp every frame with [`Shaper::release`] when it is queued,
/// and their writers hold it until then.
#[derive(Debug)]
#[cfg_attr(not(any(feature = "tcp", feature = "shm")), allow(dead_code))]
pub(crate) struct Shaper {
    link: Link,
    epoch: Instant,
}

#[cfg_attr(not(any(feature = "tcp", feature = "shm")), allow(dead_code))]
impl Shaper {
    /// `None` when `spec` shapes nothing.
    pub(crate) fn new(spec: &LinkSpec) -> Option<Self> {
        spec.is_shaped().then(|| Shaper {
            link: spec.link(),
            epoch: Instant::now(),
        })
    }

    /// Offers a frame of `wire_bytes` queued at `now`; returns when to write it.
    pub(crate) fn release(&mut self, now: Instant, wire_bytes: usize) -> Instant {
        let since = now.saturating_duration_since(self.epoch);
        self.epoch + self.link.offer(since, wire_bytes).at
    }
}

/// The α–β time of sending `bytes` over one link: `latency + bytes/rate`.
pub fn alpha_beta(bytes: f64, rate: f64, latency: Duration) -> f64 {
    latency.as_secs_f64() + bytes / rate
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_spec_parses_and_predicts() {
        let s = LinkSpec::parse(Some("1Gbit"), Some("100us")).unwrap();
        assert_eq!(s.bandwidth, Some(125e6));
        assert_eq!(s.latency, Duration::from_micros(100));
        assert!(s.is_shaped());
        assert_eq!(LinkSpec::parse(None, None).unwrap(), LinkSpec::default());
        assert!(LinkSpec::parse(Some("1Gb"), None).is_err());
        assert!(LinkSpec::parse(None, Some("1h")).is_err());
        // 64 MB on 2 ranks: 64e6/125e6 s + 2 · 100 µs.
        let t = s.predict_all_reduce(64e6, 2);
        assert!((t - (0.512 + 0.0002)).abs() < 1e-9, "{t}");
        // 4 ranks: 1.5 · size / rate + 6 latencies.
        let t = s.predict_all_reduce(64e6, 4);
        assert!((t - (0.768 + 0.0006)).abs() < 1e-9, "{t}");
        assert!((s.predict_all_gather(64e6, 4) - (0.384 + 0.0003)).abs() < 1e-9);
        assert!((s.predict_broadcast(64e6, 4) - (0.512 + 0.0003)).abs() < 1e-9);
        assert_eq!(s.predict_all_reduce(64e6, 1), 0.0);
        // Recursive doubling: log2 P rounds of the whole buffer (+2 off powers of two).
        let rd = s.predict_recursive_doubling(1e6, 4);
        assert!((rd - 2.0 * (0.008 + 0.0001)).abs() < 1e-12, "{rd}");
        let rd = s.predict_recursive_doubling(1e6, 6);
        assert!((rd - 4.0 * (0.008 + 0.0001)).abs() < 1e-12, "{rd}");
        assert_eq!(s.predict_recursive_doubling(1e6, 1), 0.0);
        // Tree broadcast: ⌈log2 P⌉ hops of the whole buffer.
        let tb = s.predict_tree_broadcast(1e6, 5);
        assert!((tb - 3.0 * (0.008 + 0.0001)).abs() < 1e-12, "{tb}");
        assert!((s.predict_tree_broadcast(1e6, 2) - (0.008 + 0.0001)).abs() < 1e-12);
        // Parameter server: the server links carry P/S shards each way.
        let ps = s.predict_parameter_server(1e6, 8, 2);
        assert!((ps - (2.0 * 4.0 * 0.008 + 0.0002)).abs() < 1e-12, "{ps}");
        let ps = s.predict_parameter_server(1e6, 2, 4);
        assert!((ps - (2.0 * 0.008 + 0.0002)).abs() < 1e-12, "{ps}");
        let lat_only = LinkSpec::parse(None, Some("1ms")).unwrap();
        assert!((lat_only.predict_all_reduce(1e9, 2) - 0.002).abs() < 1e-12);
    }

    #[test]
    fn parses_units() {
        assert_eq!(parse_bandwidth("1Gbit").unwrap(), 125e6);
        assert_eq!(parse_bandwidth("10Gbps").unwrap(), 1.25e9);
        assert_eq!(parse_bandwidth("100 Mbit").unwrap(), 12.5e6);
        assert_eq!(parse_bandwidth("2.5GB/s").unwrap(), 2.5e9);
        assert_eq!(parse_bandwidth("1MiB/s").unwrap(), 1048576.0);
        assert!(parse_bandwidth("1Gb").unwrap_err().contains("unknown unit"));
        assert!(parse_bandwidth("fast").is_err());
        assert!(parse_bandwidth("0Gbit").is_err());
        assert_eq!(parse_duration("100us").unwrap(), Duration::from_micros(100));
        assert_eq!(
            parse_duration("1.5ms").unwrap(),
            Duration::from_micros(1500)
        );
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("5 min").is_err());
    }

    #[test]
    fn alpha_beta_link_serialises_and_pipelines() {
        let lat = Duration::from_micros(100);
        let mut l = Link::new(Some(1e6), lat); // 1 MB/s
        let r1 = l.offer(Duration::ZERO, 1000);
        assert_eq!(r1.departs, Duration::from_millis(1));
        assert_eq!(r1.at, Duration::from_micros(1100));
        // Back-to-back: waits for the link, latency overlaps.
        let r2 = l.offer(Duration::from_micros(10), 2000);
        assert_eq!(r2.departs, Duration::from_millis(3));
        assert_eq!(r2.at, Duration::from_micros(3100));
        // After idling, a frame starts at once.
        let r3 = l.offer(Duration::from_millis(10), 500);
        assert_eq!(r3.departs, Duration::from_micros(10_500));
        // Total for one big transfer equals the α–β prediction.
        let mut l = Link::new(Some(125e6), lat);
        let mut last = Release {
            departs: Duration::ZERO,
            at: Duration::ZERO,
        };
        for _ in 0..64 {
            last = l.offer(Duration::ZERO, 1 << 20);
        }
        let want = alpha_beta((64 << 20) as f64, 125e6, lat);
        assert!((last.at.as_secs_f64() - want).abs() < 1e-6);
        assert!(!Link::unlimited().is_shaped());
        assert!(!LinkSpec::default().is_shaped());
        assert_eq!(
            Link::unlimited().offer(Duration::from_secs(1), 1 << 30).at,
            Duration::from_secs(1)
        );
    }

    #[test]
    fn shaper_follows_the_link_model_in_real_time() {
        assert!(Shaper::new(&LinkSpec::default()).is_none());
        let spec = LinkSpec {
            bandwidth: Some(1e6),
            latency: Duration::from_millis(2),
        };
        let mut s = Shaper::new(&spec).unwrap();
        let t0 = s.epoch + Duration::from_millis(10);
        // 1000 bytes at 1 MB/s: 1 ms on the wire, then 2 ms latency.
        assert_eq!(s.release(t0, 1000), t0 + Duration::from_millis(3));
        // Queued right behind: waits for the link; latency overlaps.
        assert_eq!(s.release(t0, 1000), t0 + Duration::from_millis(4));
        // A time before the epoch counts as the epoch.
        let mut s = Shaper::new(&spec).unwrap();
        let before = s
            .epoch
            .checked_sub(Duration::from_millis(5))
            .unwrap_or(s.epoch);
        assert_eq!(s.release(before, 0), s.epoch + Duration::from_millis(2));
    }
}
