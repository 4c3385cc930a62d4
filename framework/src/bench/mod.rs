//! Benchmarks behind `dtrain bench …`.

pub mod allreduce;
mod common;
pub mod compress;
pub mod compress_device;
pub mod exchange;
pub mod gradient;
pub mod models;
mod spec;
pub use spec::split_top_level;

/// Runs `f` on every rank of an in-process channel mesh of `world` ranks (one thread each)
/// and returns the results in rank order (tests of the measuring loops).
#[cfg(test)]
pub(crate) fn on_channel_mesh<R, F>(world: usize, f: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(&mut dtrain_comms::Communicator<dtrain_comms::ChannelTransport>) -> R
        + Send
        + Clone
        + 'static,
{
    let hs: Vec<_> = dtrain_comms::channel_mesh(world)
        .into_iter()
        .map(|t| {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut c = dtrain_comms::Communicator::new(t, Default::default());
                f(&mut c)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}
