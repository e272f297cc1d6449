//! `--ublk-poll`: what a ublk queue thread does between requests (the window of `auto`
//! and the polling loop), apart from the queue setup in `mod.rs`.

use libublk::io::{UblkIOCtx, UblkQueue};
use libublk::sys;
use std::time::{Duration, Instant};

/// The longest window of `--ublk-poll=auto`, and the longest gap between two requests it
/// grows its window for.
pub const AUTO_POLL_MAX: Duration = Duration::from_millis(2);

/// How often a spinning queue thread yields its CPU to whoever waits for it (measured on
/// the VM's instruction clock: the 2-job shapes +3-8%, the 1-job ones -2-8%, all then
/// medians >= 1.01x of btrfs on loop; docs/benchmarks.md, "Queues and the 2-job shapes").
const YIELD_EVERY: Duration = Duration::from_micros(50);

/// `--ublk-poll=auto`'s window, kept apart from the loop so it can be tested: how long to
/// poll after a batch, learnt from the gaps between batches. A gap is *close* when it
/// is at most `max` (some window would have caught the request), else *late*.
/// * The window: a close request that it missed grows it to twice that gap (at least
///   [`Self::MIN`], at most `max`); a late one halves it (below `MIN`: 0).
/// * Whether to poll at all: a score counts close requests up (+1, to
///   [`Self::SCORE_MAX`]) and late ones down (-2); the thread polls only while it is at
///   least [`Self::SCORE_ON`], i.e. while about two in three requests come close
///   together. Random sparse reads (200/s at random times: a third of the gaps under
///   2 ms) would otherwise keep a window open that mostly times out.
///
/// It starts asleep: a device nobody reads costs nothing.
#[derive(Debug, Clone)]
pub struct PollWindow {
    max: Duration,
    cur: Duration,
    score: u8,
}

impl PollWindow {
    pub const MIN: Duration = Duration::from_micros(16);
    pub const SCORE_ON: u8 = 4;
    pub const SCORE_MAX: u8 = 8;

    pub fn new(max: Duration) -> PollWindow {
        PollWindow {
            max,
            cur: Duration::ZERO,
            score: 0,
        }
    }

    /// How long to poll after the batch just handled.
    pub fn window(&self) -> Duration {
        if self.score >= Self::SCORE_ON {
            self.cur
        } else {
            Duration::ZERO
        }
    }

    /// The next request was seen `gap` after the previous batch was done (caught while
    /// polling, or after a sleep: then `gap` includes the wakeup).
    pub fn arrived(&mut self, gap: Duration) {
        if gap <= self.max {
            self.score = (self.score + 1).min(Self::SCORE_MAX);
            if gap > self.cur {
                self.cur = (gap * 2).clamp(Self::MIN, self.max);
            }
        } else {
            self.score = self.score.saturating_sub(2);
            self.cur /= 2;
            if self.cur < Self::MIN {
                self.cur = Duration::ZERO;
            }
        }
    }
}

/// The queue loop of `--ublk-poll=auto|US`: after each batch keep checking the ring (in
/// memory: IORING_SQ_TASKRUN, queued commits, posted CQEs) for `window()` before
/// sleeping in io_uring_enter. A request arriving meanwhile costs no wakeup of this
/// thread. `arrived(gap)` hears how long after the previous batch each new one came.
pub(super) fn poll_loop(
    q: &UblkQueue,
    mut handler: impl FnMut(&UblkQueue, u16),
    window: impl Fn() -> Duration,
    mut arrived: impl FnMut(Duration),
) {
    let mut on_cqe = |_: u64, cqe: &io_uring::cqueue::Entry, _: bool| {
        // what libublk's own loop hands its handler: fetched requests, not aborts
        let data = cqe.user_data();
        let target = data & libublk::UblkUringData::Target as u64 != 0;
        // target I/O: the eventfd read of deferred completions (any result: re-armed)
        if target || cqe.result() == sys::UBLK_IO_RES_OK as i32 {
            handler(q, UblkIOCtx::user_data_to_tag(data) as u16);
        }
    };
    let mut st = PollStats::default();
    let mut last = Instant::now();
    let mut last_yield = last;
    let mut spin = window();
    // after a batch, flush once more: it submits the commits and it is where libublk
    // notices an aborted (stopped) queue and returns QueueIsDown
    let mut again = false;
    loop {
        let pending = again
            || libublk::io::with_task_io_ring_mut(|r| {
                r.submission().taskrun() || !r.submission().is_empty() || !r.completion().is_empty()
            });
        if !pending && last.elapsed() < spin {
            if last_yield.elapsed() >= YIELD_EVERY {
                // a reader woken onto this CPU (by our commits, through btrfs's end-io
                // worker) would otherwise wait behind the spin until the tick preempts it
                nix::sched::sched_yield().ok();
                last_yield = Instant::now();
            }
            std::hint::spin_loop();
            continue;
        }
        if !pending {
            st.sleeps += 1;
            st.wasted += spin;
        }
        let res = q.flush_and_wake_io_tasks(&mut on_cqe, usize::from(!pending));
        if again {
            // that flush submitted the last batch's commits and so woke its readers; one
            // may have been woken onto this CPU, where it would wait behind the spin below
            // until the scheduler preempts it (EEVDF: up to a slice): let it run first
            nix::sched::sched_yield().ok();
        }
        match res {
            Ok(n) => {
                if n > 0 {
                    let gap = last.elapsed();
                    st.gaps_log2_us[(64 - (gap.as_micros() as u64).leading_zeros() as usize).min(15)] += 1;
                    if pending && !again {
                        st.hits += 1;
                        st.polled += gap;
                    }
                    arrived(gap);
                    last = Instant::now();
                    spin = window();
                }
                again = n > 0;
            }
            Err(_) => break,
        }
    }
    log::debug!("ublk queue: {st:?}");
}

/// What a queue's polling did, for `RUST_LOG=debug` when it stops: requests caught
/// while polling and the time polled for them, sleeps and the windows that ran out
/// before them, and the gaps between batches (`gaps_log2_us[i]`: gaps of 2^(i-1) to
/// 2^i microseconds).
#[derive(Debug, Default)]
struct PollStats {
    hits: u64,
    polled: Duration,
    sleeps: u64,
    wasted: Duration,
    gaps_log2_us: [u64; 16],
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_millis(2);

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// A window that has seen `n` requests `gap` apart.
    fn after(n: usize, gap: Duration) -> PollWindow {
        let mut w = PollWindow::new(MAX);
        for _ in 0..n {
            w.arrived(gap);
        }
        w
    }

    #[test]
    fn poll_window_starts_asleep_and_covers_gaps_between_close_requests() {
        assert_eq!(PollWindow::new(MAX).window(), Duration::ZERO);
        // requests 100 us apart: polling starts with the fourth, covering twice the gap
        let mut w = PollWindow::new(MAX);
        let mut seen = vec![];
        for _ in 0..5 {
            w.arrived(us(100));
            seen.push(w.window().as_micros());
        }
        assert_eq!(seen, [0, 0, 0, 200, 200]);
        // caught by the window: it stays; a longer close gap widens it, never beyond max
        w.arrived(us(10));
        assert_eq!(w.window(), us(200));
        w.arrived(us(300));
        assert_eq!(w.window(), us(600));
        w.arrived(us(1500));
        assert_eq!(w.window(), MAX);
        // tiny gaps still poll a little
        assert_eq!(after(4, us(1)).window(), PollWindow::MIN);
    }

    #[test]
    fn poll_window_survives_a_late_request_but_backs_off_when_requests_are_sparse() {
        let mut w = after(10, us(200));
        assert_eq!(w.window(), us(400));
        // one late request among close ones (the reader was descheduled): still polls
        w.arrived(us(50_000));
        assert_eq!(w.window(), us(200));
        w.arrived(us(300));
        assert_eq!(w.window(), us(600));
        // 200 reads a second, evenly (5 ms apart): off after a few, and stays off
        let mut seen = vec![];
        for _ in 0..4 {
            w.arrived(us(5000));
            seen.push(w.window().as_micros());
        }
        assert_eq!(seen, [300, 0, 0, 0]);
        for _ in 0..100 {
            w.arrived(us(5000));
        }
        assert_eq!(w.window(), Duration::ZERO);
        // a run of close requests brings it back
        for _ in 0..3 {
            w.arrived(us(50));
        }
        assert_eq!(w.window(), Duration::ZERO);
        w.arrived(us(50));
        assert_eq!(w.window(), us(100));
    }

    /// The share of the time `PollWindow` polls under Poisson arrivals of mean `gap`.
    fn poisson_poll_share(gap: Duration) -> f64 {
        let mut w = PollWindow::new(MAX);
        let mut x: u64 = 0x2545F4914F6CDD1D;
        let (mut polled, mut total) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..20000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            let g = gap.mul_f64(-(1.0 - u).ln());
            polled += w.window().min(g);
            total += g;
            w.arrived(g);
        }
        polled.as_secs_f64() / total.as_secs_f64()
    }

    #[test]
    fn poll_window_mostly_sleeps_under_random_sparse_arrivals() {
        // 200 reads/s at random times: a third of the gaps are under `max`, yet the
        // window must stay shut nearly all the time (what its polls would cost)
        let sparse = poisson_poll_share(us(5000));
        assert!(sparse < 0.02, "polled {sparse:.3} of the time");
        // 5000/s: polls most of the time (requests keep coming)
        let busy = poisson_poll_share(us(200));
        assert!(busy > 0.5, "polled {busy:.3} of the time");
    }
}
