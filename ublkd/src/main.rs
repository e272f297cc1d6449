mod blockmap;
mod bundle;
mod device;
mod frontend;
mod plumbing;
mod state;
mod stats;
mod verify;
fn main() {}
