//! A fixed set of worker threads running jobs: readahead fetches (verify) and the reads
//! frontends hand off when they would wait for a fetch (device 2's misses).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

type Job = Box<dyn FnOnce() + Send>;

pub struct Pool {
    tx: Mutex<mpsc::Sender<Job>>,
    busy: Arc<AtomicUsize>,
    workers: usize,
}

impl Pool {
    /// `workers` threads named `name-N`; they end when the pool is dropped.
    pub fn new(name: &str, workers: usize) -> Pool {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..workers {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || loop {
                    let job = rx.lock().unwrap().recv();
                    match job {
                        Ok(j) => j(),
                        Err(_) => return,
                    }
                })
                .expect("spawn pool worker");
        }
        Pool {
            tx: Mutex::new(tx),
            busy: Arc::new(AtomicUsize::new(0)),
            workers,
        }
    }

    /// Run `job` on a free worker, or return false if all are busy: a job that is only
    /// queued when a thread is free is always running (readahead never waits in a queue
    /// behind fetches that wait for a dead server).
    pub fn try_run(&self, job: impl FnOnce() + Send + 'static) -> bool {
        let w = self.workers;
        if self
            .busy
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| (b < w).then_some(b + 1))
            .is_err()
        {
            return false;
        }
        self.send(job)
    }

    /// Run `job` on the next free worker, queued behind the others if all are busy.
    pub fn run(&self, job: impl FnOnce() + Send + 'static) {
        self.busy.fetch_add(1, Ordering::AcqRel);
        self.send(job);
    }

    fn send(&self, job: impl FnOnce() + Send + 'static) -> bool {
        let busy = self.busy.clone();
        let sent = self.tx.lock().unwrap().send(Box::new(move || {
            job();
            busy.fetch_sub(1, Ordering::AcqRel);
        }));
        if sent.is_err() {
            self.busy.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn run_queues_and_try_run_refuses_when_busy() {
        let p = Pool::new("t", 2);
        let (tx, rx) = mpsc::channel();
        let gate = Arc::new(Mutex::new(()));
        let held = gate.lock().unwrap();
        for _ in 0..2 {
            let (g, tx) = (gate.clone(), tx.clone());
            assert!(p.try_run(move || {
                drop(g.lock().unwrap());
                tx.send(()).unwrap();
            }));
        }
        assert!(!p.try_run(|| {}), "both workers are busy");
        let tx2 = tx.clone();
        p.run(move || tx2.send(()).unwrap()); // queued
        drop(held);
        let t = Instant::now();
        for _ in 0..3 {
            rx.recv_timeout(Duration::from_secs(5)).unwrap();
        }
        assert!(t.elapsed() < Duration::from_secs(5));
    }
}
