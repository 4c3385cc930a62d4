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

use std::time::Duration;

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

/// The α–β time of sending `bytes` over one link: `latency + bytes/rate`.
pub fn alpha_beta(bytes: f64, rate: f64, latency: Duration) -> f64 {
    latency.as_secs_f64() + bytes / rate
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(
            Link::unlimited().offer(Duration::from_secs(1), 1 << 30).at,
            Duration::from_secs(1)
        );
    }
}
